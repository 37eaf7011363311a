"""The ``$ poollab ...`` sessions shown in the README and the docs pages, and how their output
compares.

A session is a line ``$ poollab ARGS`` inside a fenced code block (continued by a trailing
backslash), followed by the output the page shows: every line up to the next ``$`` line or the
end of the block. ``compare`` says where a run's output differs from what the page shows, looking
at every non-timing figure:

- lines are compared token by token (whitespace-separated), so a column that widens by a digit
  does not count as a difference;
- a table's header names its timing columns (``TIMING_COLUMNS``): the cells under them are not
  compared (a table is a header line followed by rows of as many tokens);
- a few timing phrases in prose lines are not compared (``TIMING_PATTERNS``: "(1.5 s)" and the
  like), nor the number of local worker processes (it follows the machine's cores);
- the size of a written HTML report is compared within ``HTML_SIZE_TOLERANCE`` (it carries the
  timing columns' digits);
- a line ``...`` on the page stands for any number of output lines (what a page leaves out);
- Python's own warnings (``file.py:12: SomeWarning: ...`` and the source line under it) are
  dropped from the run's output: they are the interpreter's, not the command's.

A page that shows ``poollab: error:`` expects exit status 2; any other session, 0. A
``$ mkdir -p DIR`` line is a session too (the test makes the folder), so that a page can make
the folder a command writes a file into.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Columns whose values are measured times (or follow from them): never compared.
TIMING_COLUMNS = frozenset(
    {
        "alloc_p50_us",
        "alloc_p99_us",
        "free_p50_us",
        "free_p99_us",
        "wall_s",
        "latency_us",
        "elapsed_s",
        "planner_s",
        "plan_s",
    }
)

#: Phrases of prose lines that carry a measured time: their numbers are not compared.
TIMING_PATTERNS = [
    (re.compile(r"\(\d[\d,.]* s\)"), "(<time> s)"),
    (re.compile(r"processes:\d+"), "processes:<n>"),
]

HTML_SIZE = re.compile(r"^wrote (\S+\.html) \((\d[\d.]*) MiB\)")
HTML_SIZE_TOLERANCE = 0.05
ELLIPSIS = "..."
PYTHON_WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning: ")


@dataclass(frozen=True)
class Session:
    page: Path
    line: int  # 1-based line of the ``$`` in the page
    command: str  # what follows ``$ `` (continuations joined)
    expected: list[str]

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.command)[
            2 if self.is_mkdir else 1 :
        ]  # past "poollab" or "mkdir -p"

    @property
    def is_mkdir(self) -> bool:
        return self.command.startswith("mkdir -p ")

    @property
    def expects_error(self) -> bool:
        return any(line.startswith("poollab: error:") for line in self.expected)


def pages() -> list[Path]:
    """The README and every docs page, in the site's order where it matters (files sorted)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def sessions(page: Path) -> list[Session]:
    """The ``$ poollab`` sessions of a page, in page order."""
    found: list[Session] = []
    lines = page.read_text().splitlines()
    in_block = False
    current: Session | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_block = not in_block
            current = None
            i += 1
            continue
        if in_block and line.startswith("$ "):
            start = i
            command = line[2:]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1].rstrip() + " " + lines[i].strip()
            current = None
            if command.startswith(("poollab ", "mkdir -p ")):
                current = Session(page, start + 1, command, [])
                found.append(current)
        elif in_block and current is not None:
            current.expected.append(line)
        i += 1
    return found


def _mask_timing(lines: list[str]) -> list[list[str]]:
    """Each line as its tokens, with timing cells and phrases masked."""
    out: list[list[str]] = []
    header: list[str] | None = None
    for line in lines:
        for pattern, repl in TIMING_PATTERNS:
            line = pattern.sub(repl, line)
        tokens = line.split()
        if any(t in TIMING_COLUMNS for t in tokens):
            header = tokens
        elif header is not None and len(tokens) == len(header):
            tokens = ["<timing>" if h in TIMING_COLUMNS else t for h, t in zip(header, tokens)]
        else:
            header = None
        out.append(tokens)
    return out


def _same_line(expected: list[str], actual: list[str]) -> bool:
    if expected == actual:
        return True
    e, a = HTML_SIZE.match(" ".join(expected)), HTML_SIZE.match(" ".join(actual))
    if e and a and e.group(1) == a.group(1):
        want, got = float(e.group(2)), float(a.group(2))
        rest_e, rest_a = expected[3:], actual[3:]
        return abs(got - want) <= HTML_SIZE_TOLERANCE * want and rest_e == rest_a
    return False


def without_python_warnings(lines: list[str]) -> list[str]:
    out: list[str] = []
    in_warning = False
    for line in lines:
        if PYTHON_WARNING.match(line):
            in_warning = True
        elif not (in_warning and line.startswith("  ")):
            in_warning = False
            out.append(line)
    return out


def compare(expected: list[str], actual: list[str]) -> str | None:
    """None when ``actual`` shows what ``expected`` does; else where they first part."""
    want = [line for line in expected if line.strip()]
    got = [line for line in without_python_warnings(actual) if line.strip()]
    want_tokens, got_tokens = _mask_timing(want), _mask_timing(got)
    return _match(want, want_tokens, got, got_tokens, 0, 0)


def _match(want, want_tokens, got, got_tokens, i, j) -> str | None:
    while i < len(want):
        if want[i].strip() == ELLIPSIS:
            if i + 1 == len(want):
                return None  # a trailing "..." takes the rest
            # the next shown line must come somewhere after: try each place
            first_error = None
            for k in range(j, len(got) + 1):
                err = _match(want, want_tokens, got, got_tokens, i + 1, k)
                if err is None:
                    return None
                first_error = first_error or err
            return first_error
        if j >= len(got):
            return f"the page shows {want[i]!r}, the run printed nothing more"
        if not _same_line(want_tokens[i], got_tokens[j]):
            return f"the page shows\n  {want[i]}\nthe run printed\n  {got[j]}"
        i += 1
        j += 1
    if j < len(got):
        return f"the run printed more than the page shows, from\n  {got[j]}"
    return None
