# The compiled build's declarations for policies/paged.py (see base.pxd).
from policies.base cimport Allocation, Policy, Segment


cdef class _Page:
    cdef public object offset, extents, handle, cache_key, pool_token
    cdef public Segment segment
    cdef public long long ref_cnt, size_bytes, nbytes


cdef class _PagedAllocation(Allocation):
    pass


cdef class _PagedCore(Policy):
    cdef public long long page_size_bytes, pages_per_segment, evictable_bytes
    cdef public list _free_pages
    cdef public dict _pages, _blocks, _queues
    cdef public bint _pages_shared

    cpdef _allocate(self, nbytes, stream, tag)
    cpdef _free(self, allocation)
