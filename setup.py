"""setuptools' entry for the opt-in compiled build of ``policies``
(``build_backend/poollab_build.py``).

Everything else is in ``pyproject.toml``; without ``POOLLAB_COMPILE=1`` this adds nothing.
"""

import sys
from pathlib import Path

from setuptools import setup

sys.path.insert(0, str(Path(__file__).resolve().parent / "build_backend"))  # also when run directly
from poollab_build import ext_modules  # noqa: E402

setup(ext_modules=ext_modules())
