"""Build hook for the opt-in compiled build of ``policies`` (README, "Compiled build").

``pip install -e .`` installs pure Python and needs no compiler. With ``POOLLAB_COMPILE=1`` the
modules in ``COMPILED_MODULES`` are compiled with Cython in pure-Python mode from the same
``.py`` files, typed by the ``.pxd`` file next to each; the in-tree build backend
(``_build/backend.py``) then adds Cython to the build requirements. Everything else
(``pyproject.toml``) is plain setuptools.
"""

import os

from setuptools import setup

#: the modules with declarations (a ``.pxd``); the rest of ``policies`` gains nothing from
#: compiling (the earlier unchanged-source build was slower) and stays interpreted
COMPILED_MODULES = ["base", "paged", "size_class"]
#: annotations stay documentation (no annotation becomes a C type or a runtime check): the
#: ``.pxd`` files and ``@cython.locals`` are the only typing
COMPILER_DIRECTIVES = {"language_level": 3, "annotation_typing": False}


def compiling() -> bool:
    return os.environ.get("POOLLAB_COMPILE", "") not in ("", "0")


def ext_modules() -> list:
    if not compiling():
        return []
    from Cython.Build import cythonize

    return cythonize([f"policies/{name}.py" for name in COMPILED_MODULES], compiler_directives=COMPILER_DIRECTIVES,
                     nthreads=os.cpu_count() or 1, quiet=True)


setup(ext_modules=ext_modules())
