# The compiled build's declarations for realgpu/live_map.py (see policies/base.pxd): the table's
# keys are C unsigned 64-bit integers (a typed memoryview over the array('Q')), and the hot path's
# two calls take the pointer as one.
cimport cython

cdef unsigned long long _HASH_MULTIPLIER, _MASK64, _EMPTY


# final: no subclass, so add/take need no check for a Python override and are called directly
@cython.final
cdef class LiveMap:
    cdef unsigned long long[:] _keys
    cdef list _values
    cdef Py_ssize_t _num_used, _mask
    cdef int _shift

    cdef void _reset(self, Py_ssize_t num_slots) except *
    cdef inline Py_ssize_t _find(self, unsigned long long key) except -1
    cpdef bint add(self, unsigned long long key, object value) except -1
    cpdef object take(self, unsigned long long key)
    cdef inline void _remove_at(self, Py_ssize_t i) noexcept
    cdef void _grow(self) except *
