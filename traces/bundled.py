"""Data files shipped inside the package (``traces/data/``), found with importlib.resources."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["bundled_path", "bundled_names"]

#: Files in ``traces/data`` that are not data.
_NOT_DATA = {"README.md", "make_slices.py", "__init__.py"}


def bundled_names() -> list[str]:
    """Names of the bundled data files."""
    root = resources.files("traces") / "data"
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_file() and p.name not in _NOT_DATA and not p.name.startswith(".")
    )


def bundled_path(name: str) -> Path:
    """Path of a bundled data file, e.g. ``bundled_path("azure_code_slice.csv")``.

    Raises:
        FileNotFoundError: no bundled file of that name (the message lists the ones there are).
    """
    res = resources.files("traces") / "data" / name
    if name in _NOT_DATA or not res.is_file():
        raise FileNotFoundError(
            f"no bundled data file {name!r}; bundled: {', '.join(bundled_names())}"
        )
    # a regular install unpacks the package, so the resource is a real file already
    return Path(str(res))
