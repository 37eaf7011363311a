"""poollab's build backend: setuptools, plus the opt-in compiled build of ``policies``.

``pip install -e .`` is plain setuptools (pure Python, no compiler needed). With the environment
variable ``POOLLAB_COMPILE=1`` the modules of ``policies`` and ``realgpu`` that have
declarations (a ``.pxd`` file next to the ``.py``: ``realgpu.malloc_path``, ``GpuPool.malloc``'s
hot path, in ``realgpu``) are compiled with Cython in pure-Python mode from the same ``.py``
files, and Cython joins the build requirements (only then). The in-tree backend is setuptools'
documented way to add build requirements dynamically; ``setup.py`` asks ``ext_modules()``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403 (every hook not wrapped below is setuptools')

#: set to 1 (or anything but 0) to compile
COMPILE_ENV = "POOLLAB_COMPILE"
CYTHON_REQUIREMENT = "cython>=3.1"
#: annotations stay documentation (none becomes a C type or a runtime check): the ``.pxd`` files
#: and ``@cython.locals`` are the only typing, so both builds accept the same values
COMPILER_DIRECTIVES = {"language_level": 3, "annotation_typing": False}


def c_macros(version_info: tuple[int, ...] = tuple(sys.version_info)) -> list[tuple[str, str]]:
    """C macros for the generated code on the Python that builds it (``version_info``).

    Cython caches two lookups behind CPython's dict version tags (PEP 509): a ``cpdef`` method's
    check that no Python subclass overrides it, and module globals. It stops using the tags from
    Python 3.12, where they are deprecated (PEP 699), although 3.12 and 3.13 still keep them;
    they go in 3.14. Without them every call of ``_allocate``/``_free`` on ``Paged`` or
    ``SizeClass`` (Python subclasses of the compiled cores) looks the method up on the instance
    and builds a bound method first: compiled paged took 98-104 ns per event on 3.11 and 167-178 ns
    on 3.12, 117-123 ns with the tags (benchmarks/RESULTS.md, "The compiled build on Python
    3.12"). So they are turned back on where CPython still keeps them up to date.
    """
    if (3, 12) <= tuple(version_info[:2]) < (3, 14):
        return [("CYTHON_USE_DICT_VERSIONS", "1")]
    return []


#: gcc and clang warn at each use of the deprecated tag (``c_macros``): said once, in its docstring
QUIET_DEPRECATED_FLAGS = ["-Wno-deprecated-declarations"] if os.name == "posix" else []
#: gcc and clang at -O3 whatever sysconfig's CFLAGS say: setuptools puts ``extra_compile_args``
#: after them, so the last -O wins. Distribution Pythons (Ubuntu's 3.12.3) say -O2, pyenv's -O3;
#: compiled size-class took 107 ns per event at -O3 and 112 at -O2 on dev's 3.12
#: (benchmarks/RESULTS.md, "Python 3.12's extra cost in the compiled build, measured")
OPTIMIZE_FLAGS = ["-O3"] if os.name == "posix" else []


def compiling() -> bool:
    return os.environ.get(COMPILE_ENV, "") not in ("", "0")


#: the packages whose declared modules are compiled: the policies, and ``GpuPool.malloc``'s hot path
COMPILED_PACKAGES = ("policies", "realgpu")


def compiled_modules(root: str | Path = ".") -> list[str]:
    """``PACKAGE/NAME.py`` for every ``PACKAGE/NAME.pxd``: a module is compiled iff it is
    declared."""
    return sorted(
        str(pxd.relative_to(root).with_suffix(".py"))
        for package in COMPILED_PACKAGES
        for pxd in Path(root, package).glob("*.pxd")
    )


#: True while setuptools runs ``setup.py`` to list build requirements, before Cython is installed
_listing_requirements = False


def ext_modules() -> list:
    """The extension modules ``setup.py`` builds: none unless ``compiling()``."""
    if not compiling() or _listing_requirements:
        return []
    from Cython.Build import cythonize

    extensions = cythonize(
        compiled_modules(),
        compiler_directives=COMPILER_DIRECTIVES,
        nthreads=os.cpu_count() or 1,
        quiet=True,
    )
    macros = c_macros()
    for ext in extensions:
        ext.define_macros += macros
        ext.extra_compile_args += OPTIMIZE_FLAGS
        if macros:
            ext.extra_compile_args += QUIET_DEPRECATED_FLAGS
    return extensions


def _requires(setuptools_hook, config_settings) -> list[str]:
    global _listing_requirements
    _listing_requirements = True
    try:
        requires = setuptools_hook(config_settings)
    finally:
        _listing_requirements = False
    return requires + ([CYTHON_REQUIREMENT] if compiling() else [])


def get_requires_for_build_wheel(config_settings=None):
    return _requires(_setuptools.get_requires_for_build_wheel, config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _requires(_setuptools.get_requires_for_build_editable, config_settings)
