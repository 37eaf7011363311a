"""A sweep key's version comes from below the CLI: the installed distribution, else
pyproject.toml."""

import importlib.metadata
import tomllib
from pathlib import Path

from sim.sweep import cells


def test_a_source_checkout_reads_the_version_from_pyproject(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    cells._poollab_version.cache_clear()
    try:
        pyproject = tomllib.loads(
            (Path(cells.__file__).resolve().parents[2] / "pyproject.toml").read_text()
        )
        assert cells._poollab_version() == pyproject["project"]["version"]
    finally:
        cells._poollab_version.cache_clear()
