# The compiled build's declarations for realgpu/malloc_path.py (see policies/base.pxd).
cimport cython
from policies._blocks cimport Block, bisect_ints
from policies.base cimport Allocation
from realgpu.live_map cimport LiveMap

cdef bint _COMPILED


cdef class MallocPath:
    cdef public object pool, allocate, free, pointer_type, memory_type, device_id
    cdef public list starts, bases, lease_errors
    cdef public bint closed


cdef class Lease:
    cdef public MallocPath path
    cdef public object allocation



cdef class TorchPath:
    cdef public object core, allocate, free_policy, last_stream
    cdef public list starts, bases, queued
    cdef public LiveMap live
    cdef public long long countdown, extra_bytes, align_mask
    cdef public bint in_malloc, fast
    cdef public Py_ssize_t segment_index


# PyTorch's two calls, as C functions the trampoline calls by address (TorchPath.entry_addresses)
# malloc's answer is the pointer as a C integer (0 with the error set: no pointer is 0); free's
# pointer and size come as C integers
cdef unsigned long long torch_malloc(TorchPath path, object size, object stream) except? 0
cdef object torch_free(TorchPath path, unsigned long long ptr, unsigned long long size)


cpdef bint extents_are_one_range(object extents, list starts) except -1
