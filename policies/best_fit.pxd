# The compiled build's declarations for policies/best_fit.py (see base.pxd).
from policies.base cimport Allocation, Policy, Segment


cdef class _BestFitCore(Policy):
    cdef public object _round_mask  # None when the rounding is not a power of two
    cdef public long long _split_min_bytes
    cdef public dict _keys_by_stream, _free_at

    cpdef _allocate(self, nbytes, stream, tag)
    cpdef _free(self, allocation)
