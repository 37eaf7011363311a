"""Every ``$ poollab ...`` the README and the docs pages show runs on bundled data, and prints what
the page shows in every non-timing figure (``docs_sessions``: how sessions are found and compared);
every ``>>>`` Python session runs as a doctest.

Each page's sessions run in order in one temporary folder (a later one may read what an earlier
one wrote, as a reader following the page would), with the repository's folders that pages read
(``LINKED``) linked into it, so that the pages' relative paths work and their outputs
(``poollab-out/``, covered by ``.gitignore``) land in the temporary folder.
"""

from __future__ import annotations

import contextlib
import doctest
import faulthandler
import gc
import io
import os
import re
import subprocess
import sys

import pytest

from docs_sessions import ROOT, Session, compare, pages, sessions
from poollab.__main__ import run as entry_point

LINKED = ("traces", "examples", "docs", "benchmarks", "tests")
TIMEOUT_S = 300


def run(session: Session, cwd) -> subprocess.CompletedProcess:
    """Run the session's ``poollab ARGS`` in ``cwd`` and in this process, through the console
    script's own entry point (``poollab.__main__.run``), with stdout and stderr in one stream as a
    terminal shows them (a ``StringIO``: no terminal, so no progress bar, as on a pipe).

    In-process rather than ``python -m poollab`` per session: a subprocess paid the interpreter's
    start and the imports of pandas and the simulator again for each of ~40 sessions (~30 s of
    CPU of ~110). The real process's exit statuses and one-line errors are tested on their own
    (``tests/poollab``, ``..._through_the_real_entry_point``). A session still running after
    ``TIMEOUT_S`` ends the test process with every thread's traceback (``faulthandler``).
    """
    out = io.StringIO()
    saved_cwd, saved_argv, saved_columns = os.getcwd(), sys.argv, os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "200"  # the width the pages were written at
    sys.argv = ["poollab", *session.argv]
    os.chdir(cwd)
    faulthandler.dump_traceback_later(TIMEOUT_S, exit=True)
    frozen_before = gc.get_freeze_count()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                entry_point(session.argv)
                code = 0
            except (
                SystemExit
            ) as exc:  # as the interpreter ends: an int is the status, a message goes to stderr
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
    finally:
        if frozen_before == 0:  # the entry point freezes all it made as the process would end
            gc.unfreeze()
        faulthandler.cancel_dump_traceback_later()
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        if saved_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved_columns
    return subprocess.CompletedProcess(["poollab", *session.argv], code, out.getvalue())


PAGES = [p for p in pages() if sessions(p)]


def test_the_pages_show_sessions():
    # the README's four workflows and the docs' workflow pages: a parser that found none would pass
    assert sessions(ROOT / "README.md"), "the README shows no $ poollab session"
    assert sum(len(sessions(p)) for p in pages()) >= 20


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_sessions_print_what_the_page_shows(page, tmp_path):
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    for session in sessions(page):
        if session.is_mkdir:
            for folder in session.argv:
                (tmp_path / folder).mkdir(parents=True, exist_ok=True)
            assert not session.expected, f"{session.where}: mkdir prints nothing"
            continue
        done = run(session, tmp_path)
        want_rc = 2 if session.expects_error else 0
        assert done.returncode == want_rc, (
            f"{session.where}: `{session.command}` exited {done.returncode}, "
            f"expected {want_rc}:\n{done.stdout[-3000:]}"
        )
        diff = compare(session.expected, done.stdout.splitlines())
        assert diff is None, (
            f"{session.where}: `{session.command}`: {diff}\n--- the run printed:\n{done.stdout}"
        )


def _doctest_blocks(page):
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    return [b for b in blocks if b.lstrip().startswith(">>>")]


DOCTEST_PAGES = [p for p in pages() if _doctest_blocks(p)]


@pytest.mark.parametrize(
    "page", DOCTEST_PAGES, ids=[str(p.relative_to(ROOT)) for p in DOCTEST_PAGES]
)
def test_page_python_sessions_print_what_the_page_shows(page, monkeypatch):
    # ">>>" blocks are Python sessions with their output: run them as doctests, from the root
    monkeypatch.chdir(ROOT)
    parser, runner = (
        doctest.DocTestParser(),
        doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE),
    )
    for number, block in enumerate(_doctest_blocks(page)):
        runner.run(parser.get_doctest(block, {}, f"{page.name}[{number}]", str(page), 0))
    assert runner.summarize(verbose=False).failed == 0
