"""Writing outputs all or nothing: a run that fails while writing leaves what was there before.

``replacing_file(path)`` yields a temporary path beside ``path`` and renames it over ``path``
when the block ends without an error; ``replacing_folder(path)`` does the same for a folder of
results. The temporary is beside the target (same file system), so the final rename is atomic;
on any error it is removed and the target is exactly as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

__all__ = ["replacing_file", "replacing_folder"]


@contextlib.contextmanager
def replacing_file(path: str | Path) -> Iterator[Path]:
    """A temporary file beside ``path`` to write; it replaces ``path`` if the block succeeds.

    A target that exists and is not a regular file (``/dev/null``, a FIFO) is written in place:
    it cannot be renamed over, and there is nothing on it to keep.
    """
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        yield path
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, path)
    finally:
        tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def replacing_folder(path: str | Path, *, carry: Callable[[Path], bool] = lambda p: False) -> Iterator[Path]:
    """A temporary folder beside ``path`` to fill; it takes the place of ``path`` if the block succeeds.

    Args:
        path: the result folder (created with its parents if missing).
        carry: entries of an existing ``path`` for which this is true move into the new folder
            unless it has an entry of that name (e.g. a sweep's ``cells/``, or files that are
            not results); the others (the previous run's tables) go.

    The swap is two renames (old folder aside, new one in place) and the moves of carried
    entries; a failure between the renames puts the old folder back.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(20, "Not a directory", str(path))
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        _swap_in(tmp, path, carry)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(new: Path, path: Path, carry: Callable[[Path], bool]) -> None:
    if not path.exists():
        os.rename(new, path)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    os.rename(path, old / "x")  # rename aside (into a fresh folder: rename cannot replace a non-empty one)
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(old / "x", path)
        old.rmdir()
        raise
    for entry in (old / "x").iterdir():
        if carry(entry) and not (path / entry.name).exists():
            os.rename(entry, path / entry.name)
    shutil.rmtree(old, ignore_errors=True)
