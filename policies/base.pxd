# The compiled build's declarations for policies/base.py (Cython's pure-Python mode: this file
# augments the .py, which stays the one source). Interpreted, nothing here is read.
# Counters and sizes are C 64-bit integers (exact up to 2**63 - 1 bytes: any device is far below).
cimport cython


# no @cython.freelist here: Cython does not apply one given in an augmenting .pxd (checked in
# the generated C), and one that works saved nothing in the replay (benchmarks/RESULTS.md)
cdef class Allocation:
    cdef public long long nbytes, size_bytes
    cdef public object _extents, stream, tag, handle, owner  # ``extents``: a property over ``_extents``


cdef class Segment:
    cdef public long long num_live
    cdef public object offset, nbytes, stream, handle


cdef class Policy:
    # attributes a subclass adds (its knobs, its state) live in the instance dict, as in Python
    cdef dict __dict__
    cdef public object capacity_bytes, device, _token, _max_request_bytes  # a test policy lifts the limit past 2**63
    cdef public dict _segments
    cdef public bint _frozen
    cdef public long long _frozen_refusal_at
    cdef public long long live_bytes, allocated_bytes, reserved_bytes, num_allocs, num_frees, num_failures
    cdef public long long num_grows, num_shrinks, grown_bytes, shrunk_bytes, peak_live_bytes
    cdef public long long peak_allocated_bytes, peak_reserved_bytes, num_frozen_failures

    cpdef _allocate(self, nbytes, stream, tag)
    cpdef _free(self, allocation)
