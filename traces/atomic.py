"""Writing outputs all or nothing: a run that fails, or is killed, while writing leaves what was
there before.

``replacing_file(path)`` yields a temporary path beside ``path`` and renames it over ``path``
when the block ends without an error; ``replacing_folder(path)`` does the same for a folder of
results. Temporaries are beside the target (same file system, so the final rename is atomic)
and named ``.poollab-<pid>-<random>.tmp`` (short: a legal 250-character target name still has
room for them); the next replace in that folder removes those of runs that died.

A result folder is swapped whole, with one atomic exchange of two paths (Linux's
``renameat2(RENAME_EXCHANGE)``): at every instant ``--out`` holds the old run or the complete
new one, never neither. What the folder holds that the tool did not write (a sweep's ``cells/``,
the user's notes) is hard-linked into the new folder before the exchange, so a kill at any step
strands nothing. The tool lists what it wrote in ``.poollab-files.json`` inside the folder: the
next run replaces those entries and keeps every other one; a kept entry whose name the new run
also writes is refused (nothing is changed) rather than overwritten. Where the exchange is not
available (another OS or file system) the swap falls back to two renames, and a run killed
between them is repaired by the next replace (the old folder is put back).

``--out`` given as a symlink is followed (the results go where it points and the link stays);
the current folder, or a folder holding it, is refused (replacing it would leave the shell in a
deleted folder). New files and folders get their modes from the umask, like any other file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterable, Iterator

__all__ = [
    "replacing_file",
    "replacing_folder",
    "check_out_folder",
    "naming_errors",
    "written_files",
    "ManifestError",
    "process_alive",
    "MANIFEST_NAME",
    "TEMP_PREFIX",
]

#: The list of what the tool wrote into a result folder (JSON: ``{"written_by", "files"}``).
MANIFEST_NAME = ".poollab-files.json"
#: Every temporary this module makes starts so: ``.poollab-<pid>-<hex>.tmp`` (or ``.old``).
TEMP_PREFIX = ".poollab-"
_RENAME_EXCHANGE = 2  # <linux/fs.h>
_AT_FDCWD = -100


@contextlib.contextmanager
def naming_errors(path: str | Path) -> Iterator[None]:
    """An ``OSError`` without a file name raised in the block (a full disk during ``write()``,
    pyarrow's I/O errors) is raised again naming ``path``: the one error line says which file."""
    try:
        yield
    except OSError as exc:
        if exc.filename:
            raise
        code = exc.errno or errno.EIO
        reason = exc.strerror or " ".join(str(exc).split()) or os.strerror(code)
        raise type(exc)(code, reason, str(path)) from exc


@contextlib.contextmanager
def replacing_file(path: str | Path) -> Iterator[Path]:
    """A temporary file beside ``path`` to write; it replaces ``path`` if the block succeeds.

    A target that exists and is not a regular file (``/dev/null``, a FIFO) is written in place:
    it cannot be renamed over, and there is nothing on it to keep. A symlink is followed.
    An error without a file name (a full disk) names ``path``.
    """
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        with naming_errors(path):
            yield path
        return
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    tmp = _temp_file(target.parent)
    try:
        with naming_errors(path):
            yield tmp
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def replacing_folder(
    path: str | Path,
    *,
    legacy_outputs: Callable[[Path], bool] | None = None,
    carry: Callable[[Path], bool] | None = None,
) -> Iterator[Path]:
    """A temporary folder beside ``path`` to fill; it takes the place of ``path`` if the block
    succeeds.

    Args:
        path: the result folder (created with its parents if missing; a symlink is followed).
        legacy_outputs: for an existing folder without ``.poollab-files.json`` (written before
            the tool kept that list), which of its entries are an earlier run's outputs, to be
            replaced; every other entry is kept. None: keep every entry.
        carry: the older spelling, its opposite: entries of such a folder to keep.

    Raises:
        NotADirectoryError: ``path`` is a file.
        FileExistsError: the new run writes an entry of a name the tool did not write before
            (the user's file): nothing is changed.
        OSError (EBUSY): ``path`` is the current folder or holds it.
    """
    if carry is not None and legacy_outputs is None:
        legacy_outputs = lambda entry: not carry(entry)  # noqa: E731
    target = _resolve_out(Path(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(path))
    _remove_dead_temporaries(target.parent)
    tmp = _temp_dir(target.parent, ".tmp")
    leftover = tmp
    try:
        yield tmp
        leftover = _swap_in(tmp, target, path, legacy_outputs)
    finally:
        if leftover is not None:
            shutil.rmtree(leftover, ignore_errors=True)


def written_files(folder: str | Path) -> set[str] | None:
    """The names the tool wrote into ``folder`` (its ``.poollab-files.json``), or None without that
    list."""
    p = Path(folder) / MANIFEST_NAME
    try:
        doc = json.loads(p.read_bytes())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ManifestError(
            p, f"not a readable list of the files poollab wrote ({' '.join(str(exc).split())})"
        ) from None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise ManifestError(
            p, 'not a list of the files poollab wrote (expected {"files": [names]})'
        )
    return set(files)


class ManifestError(ValueError):
    """A ``.poollab-files.json`` that is no list of names: ``path``, ``reason``."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}")


def _resolve_out(path: Path) -> Path:
    """The real folder behind ``path`` (symlinks followed, ``.``/``..`` resolved); refuse the
    root, the current folder and any folder holding it."""
    real = Path(os.path.realpath(path))
    if real.parent == real:
        raise IsADirectoryError(
            errno.EBUSY,
            "the file system's root cannot be a result folder; choose another --out",
            str(path),
        )
    cwd = Path(os.path.realpath(os.getcwd()))
    if real == cwd or real in cwd.parents:
        raise IsADirectoryError(
            errno.EBUSY,
            "is the current folder (or holds it): "
            "replacing it would leave you in a deleted folder; "
            "give a folder inside it, e.g. --out ./results",
            str(path),
        )
    return real


def _swap_in(
    new: Path, target: Path, shown: str | Path, legacy_outputs: Callable[[Path], bool] | None
) -> Path | None:
    """Make ``new`` the folder at ``target``; returns what is left to remove (the old folder)."""
    wrote = sorted(entry.name for entry in new.iterdir())
    _write_manifest(new, wrote)
    if not target.exists():
        os.rename(new, target)
        return None
    kept = _kept_entries(target, wrote, shown, legacy_outputs)
    for entry in kept:  # in both folders until the old one goes: a kill at any step strands nothing
        _link_tree(entry, new / entry.name)
    return _exchange(new, target)


def _kept_entries(
    target: Path,
    writes: Iterable[str],
    shown: str | Path,
    legacy_outputs: Callable[[Path], bool] | None,
) -> list[Path]:
    """The entries of the existing folder ``target`` that a new run keeps (all but the tool's own);
    FileExistsError when one of them has a name in ``writes``."""
    try:
        before = written_files(target)
    except (
        ManifestError
    ) as exc:  # a writer's error is an OSError (one line, exit 2, nothing changed)
        raise OSError(
            errno.EINVAL,
            f"{exc.reason}; fix or remove it, or choose another --out (nothing was changed)",
            str(exc.path),
        ) from None
    if before is None:
        before = {
            e.name for e in target.iterdir() if legacy_outputs is not None and legacy_outputs(e)
        }
    kept = [e for e in target.iterdir() if e.name not in before and e.name != MANIFEST_NAME]
    clash = sorted(e.name for e in kept if e.name in set(writes))
    if clash:
        raise FileExistsError(
            errno.EEXIST,
            f"poollab did not write it, so it is not replaced ({len(clash)} such: "
            f"{', '.join(clash[:3])}); move it away or choose another --out (nothing was changed)",
            str(Path(shown) / clash[0]),
        )
    return kept


def check_out_folder(
    path: str | Path,
    *,
    writes: Iterable[str] = (),
    legacy_outputs: Callable[[Path], bool] | None = None,
) -> None:
    """Raise now what ``replacing_folder(path)`` would raise at the end of a run that writes the
    entries ``writes``: the root or current folder, a file, a file of the user's in the way.
    Commands call it before any work, so that a refusal does not come after hours of it
    (``writes`` empty: the refusals that do not depend on what the run writes)."""
    target = _resolve_out(Path(path))
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(path))
    if target.is_dir() and writes:
        _kept_entries(target, writes, path, legacy_outputs)


def _write_manifest(folder: Path, names: list[str]) -> None:
    doc = {"written_by": "poollab", "files": names}
    (folder / MANIFEST_NAME).write_text(json.dumps(doc, indent=1) + "\n")


def _link_tree(src: Path, dst: Path) -> None:
    """``src`` at ``dst`` too: folders made anew (mode kept), everything else hard-linked (a copy
    where the file system refuses the link)."""
    if src.is_dir() and not src.is_symlink():
        os.mkdir(dst)
        shutil.copymode(src, dst)
        for entry in src.iterdir():
            _link_tree(entry, dst / entry.name)
        return
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)


def _exchange(new: Path, target: Path) -> Path:
    """Swap the folders at ``new`` and ``target`` atomically; returns where the old one now is."""
    if _rename_exchange(new, target):
        return new
    # No atomic exchange here: two renames, the old folder first put aside into a folder that
    # says where it belongs, so that a kill between them is repaired by the next replace.
    aside = _temp_dir(target.parent, ".old")
    (aside / "target").write_text(target.name)
    os.rename(target, aside / "x")
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(aside / "x", target)
        raise
    return aside


def _rename_exchange(a: Path, b: Path) -> bool:
    """``renameat2(a, b, RENAME_EXCHANGE)``; False where the system or file system lacks it."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes  # here, not at the top: every command's ``--out`` check imports this module

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def _temp_name(suffix: str) -> str:
    import secrets  # here: hashlib and hmac are 20 ms of a command's start (``_rename_exchange``)

    return f"{TEMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}{suffix}"


def _temp_dir(parent: Path, suffix: str) -> Path:
    while True:
        p = parent / _temp_name(suffix)
        try:
            os.mkdir(p, 0o777)  # the umask decides, as for any folder
            return p
        except FileExistsError:
            continue


def _temp_file(parent: Path) -> Path:
    while True:
        p = parent / _temp_name(".tmp")
        try:
            os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask decides
            return p
        except FileExistsError:
            continue


def _remove_dead_temporaries(parent: Path) -> None:
    """Temporaries of runs that died (their pid is gone): a folder put aside between two renames
    goes back where it belongs when nothing took its place; the rest is removed."""
    try:
        entries = [
            e
            for e in parent.iterdir()
            if e.name.startswith(TEMP_PREFIX) and e.suffix in (".tmp", ".old")
        ]
    except OSError:
        return
    for entry in entries:
        pid_text = entry.name[len(TEMP_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or int(pid_text) == os.getpid() or process_alive(int(pid_text)):
            continue
        if entry.suffix == ".old" and (entry / "x").is_dir():
            try:
                home = parent / (entry / "target").read_text()
                if not home.exists() and home.parent == parent:
                    os.rename(entry / "x", home)
                elif not home.exists():
                    continue
            except OSError:
                continue  # unsure: leave it for a person rather than lose a run
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not): whether a
    temporary named by its pid may still be in use (and, for a sweep's workers, their parent)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc: os.kill said it exists
        return True
