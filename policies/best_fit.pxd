# The compiled build's declarations for policies/best_fit.py (see base.pxd).
cimport cython
from policies.base cimport Allocation, Policy, Segment
from policies._blocks cimport Block, bisect_blocks, bisect_ints, cut_block, merge_down

cdef bint _COMPILED

cdef bint _precedes(Block a, Block b) noexcept  # a static C function: inlined by the C compiler


cdef class _BestFitCore(Policy):
    cdef public dict _keys_by_stream, _blocks_by_stream
    cdef public object _hot_stream
    cdef public list _hot_keys, _hot_blocks
    cdef public object _round_mask
    cdef public long long _split_min_bytes, _key_shift
    # Python ints: compared with a request or a segment size (Python ints, maybe past 2**63) as objects
    cdef public object _key_size_limit, _rounded_request_limit
    cdef public object _offset_mask  # read by subclasses (vmm_stitch), not by the hot paths

    cpdef _allocate(self, nbytes, stream, tag)
    cpdef _free(self, allocation)
