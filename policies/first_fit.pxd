# The compiled build's declarations for policies/first_fit.py (see base.pxd).
cimport cython
from policies.base cimport Allocation, Policy, Segment
from policies._blocks cimport Block, bisect_ints, cut_block, merge_down

cdef bint _COMPILED

cpdef Py_ssize_t _first_at_least(list sizes, object size) except -2


cdef class _FirstFitCore(Policy):
    cdef public dict _free_by_stream, _chunked_by_stream
    cdef public object _hot_stream
    cdef public tuple _hot_lists
    cdef public object _round_mask
    cdef public long long _split_min_bytes

    cpdef _allocate(self, nbytes, stream, tag)
    cpdef _free(self, allocation)
