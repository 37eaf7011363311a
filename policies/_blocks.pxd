# The compiled build's declarations for policies/_blocks.py (see base.pxd).
# A block's offset and size are C 64-bit integers, as Allocation's sizes are (offsets below 2**63).
cimport cython
from policies.base cimport Allocation, Policy, Segment


cdef class Block(Allocation):
    cdef public long long offset, size
    cdef public Segment segment
    cdef public Block prev, next
    cdef public bint free


cpdef Py_ssize_t bisect_ints(list values, long long value) except -1
cpdef Py_ssize_t bisect_blocks(list blocks, long long size, long long offset) except -1
cpdef Block cut_block(Block block, long long size, nbytes, stream, tag, long long split_min_bytes)
cpdef void merge_down(Block block, Block nxt, Block prev, Segment seg)
