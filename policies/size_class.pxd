# The compiled build's declarations for policies/size_class.py (see base.pxd).
from policies.base cimport Allocation, Policy, Segment


cdef class _Block:
    cdef public object offset, extents
    cdef public long long size_bytes, class_index
    cdef public Segment segment
    cdef public list home


cdef class _SizeClassCore(Policy):
    cdef public long long _table_max_bytes
    cdef public object max_class_bytes
    cdef public list _class_by_units, _class_sizes, _free_lists, _large_cache

    cpdef _allocate(self, nbytes, stream, tag)
    cpdef _free(self, allocation)
