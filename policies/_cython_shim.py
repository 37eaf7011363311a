"""The names of Cython's pure-Python mode that ``policies`` uses, as no-ops, for a pure install.

The compiled build (docs/guides/compiled-build.md) declares the hot classes as ``cdef class`` in the
``.pxd`` file next to each module and types a few locals with ``@cython.locals``; interpreted,
those declarations must change nothing and cost nothing, and Cython must not be needed. With
Cython installed its own ``cython`` module (the same no-ops) is used; without it, this one::

    try:
        import cython
    except ImportError:  # a pure install: the same names as no-ops
        from policies._cython_shim import cython

(Cython's compiler reads ``import cython`` as its magic module in that pattern.)
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable


def _keep(*_args: Any, **_kwargs: Any) -> Callable[[Any], Any]:
    """A decorator factory whose decorator returns what it decorates."""
    return lambda f: f


#: the subset of Cython's shadow module the sources use: C types read as Python's, decorators as
#: no-ops
cython = SimpleNamespace(
    compiled=False,
    longlong=int,
    ulonglong=int,
    Py_ssize_t=int,
    bint=bool,
    locals=_keep,
    boundscheck=_keep,
    wraparound=_keep,
    cast=lambda _type, value: value,
)
