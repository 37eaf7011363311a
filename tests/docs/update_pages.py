"""Rewrite the output the pages show from fresh runs, where it no longer matches.

    python tests/docs/update_pages.py [PAGE ...]      # default: the README and every docs page

Runs each page's ``$ poollab`` sessions as ``test_docs_commands`` does (one temporary folder per
page, in order) and, for a session whose output differs from the page in a non-timing figure,
puts the run's output in the page instead. A session whose shown output leaves lines out
(``...``) is not rewritten: it is listed, to be edited by hand. Review the diff before committing:
a changed figure is a change in behaviour that the commit message should explain.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from docs_sessions import ELLIPSIS, ROOT, compare, pages, sessions, without_python_warnings  # noqa: E402
from test_docs_commands import LINKED, run  # noqa: E402


def update(page: Path) -> list[str]:
    """Rewrite ``page`` in place; return the sessions left for a hand edit."""
    lines = page.read_text().splitlines()
    by_line: dict[int, list[str]] = {}
    by_hand: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in LINKED:
            (Path(tmp) / name).symlink_to(ROOT / name)
        for session in sessions(page):
            if session.is_mkdir:
                for folder in session.argv:
                    (Path(tmp) / folder).mkdir(parents=True, exist_ok=True)
                continue
            done = run(session, tmp)
            actual = [line.rstrip() for line in without_python_warnings(done.stdout.splitlines())]
            if compare(session.expected, actual) is None:
                continue
            if any(line.strip() == ELLIPSIS for line in session.expected):
                by_hand.append(f"{session.where}: `{session.command}`")
                continue
            by_line[session.line] = actual
    expected_len = {s.line: len(s.expected) for s in sessions(page)}
    out: list[str] = []
    i = 0  # index of the next line of the page to copy
    while i < len(lines):
        start = i + 1  # this line's 1-based number
        out.append(lines[i])
        i += 1
        if start in by_line:
            while out[-1].endswith("\\"):  # the command's continuation lines stay
                out.append(lines[i])
                i += 1
            out.extend(by_line[start])  # the new output replaces the old
            i += expected_len[start]
    page.write_text("\n".join(out) + "\n")
    return by_hand


def main(argv: list[str]) -> int:
    targets = [Path(a).resolve() for a in argv] or pages()
    left: list[str] = []
    for page in targets:
        if sessions(page):
            left += update(page)
    for where in left:
        print(f"edit by hand (its output leaves lines out): {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
