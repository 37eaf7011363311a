"""The command line's help texts and messages (``poollab/``, and the simulator options' in
``sim/serving/config.py``) are split into adjacent string literals only between whole phrases
(issue 32's leftovers: session 13's line-wrapping tool split ``"every call up to 20,000 "
"events"`` and 66 more mid-phrase).

A split reads as prose where the first piece ends a clause (``. ``, ``: ``, ``; ``, ``, ``, a
newline), or the second starts a parenthesis or a word that starts a clause or phrase (``and``,
``with``, ``the``, ...), or a replacement field stands on either side of it (a label and its
value, where the expression fills the line).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Where the simulator options' help texts are written (each ``ServerConfig`` field's ``Knob``).
KNOB_HELP = "sim/serving/config.py"
CLAUSE_ENDS = (". ", ": ", "; ", ", ", "\\n")
STARTS_A_PHRASE = set(
    "and or but which when where while because so if unless than whose who then nor since until "
    "with to for from of in at by as on into before after without per over under via through "
    "between across against about that the a an each every its their not".split()
)


def _literals(code: str) -> list[tuple[int, int, str]]:
    """``(first line, last line, source)`` of each string literal, then ``(0, 0, "")`` where
    something else comes between two (Python 3.12 tokenizes an f-string as several tokens)."""
    lines = code.splitlines(keepends=True)
    out, depth, start = [], 0, None
    for tok in tokenize.generate_tokens(io.StringIO(code).readline):
        name = tokenize.tok_name[tok.type]
        if name == "FSTRING_START":
            depth += 1
            start = tok.start if depth == 1 else start
        elif name == "FSTRING_END":
            depth -= 1
            if depth == 0:
                (r0, c0), (r1, c1) = start, tok.end
                text = "".join(lines[r0 - 1 : r1])
                end = len(text) - len(lines[r1 - 1]) + c1
                out.append((r0, r1, text[c0:end]))
        elif depth:
            continue
        elif tok.type == tokenize.STRING:
            out.append((tok.start[0], tok.end[0], tok.string))
        elif tok.type not in (tokenize.NL, tokenize.COMMENT):
            out.append((0, 0, ""))
    return out


def _body(literal: str) -> str:
    quote = re.match(r"(?i)[rbuf]*('''|\"\"\"|'|\")", literal)
    return literal[quote.end() : -len(quote.group(1))]


def mid_phrase_splits(code: str) -> list[str]:
    """``line: ...end|start...`` of each split of adjacent literals that does not read as
    prose."""
    out = []
    pieces = _literals(code)
    for (_, end_line, first), (start_line, _, second) in zip(pieces, pieces[1:]):
        if not first or not second or start_line == end_line:
            continue
        a, b = _body(first), _body(second)
        word = re.match(r"[A-Za-z]*", b).group(0)
        if not (
            a.endswith(CLAUSE_ENDS)
            or b[:1] == "("
            or word in STARTS_A_PHRASE
            or a.endswith(("}", "} "))
            or b.startswith("{")
        ):
            out.append(f"{end_line}: ...{a[-30:]}|{b[:30]}...")
    return out


def test_the_command_lines_strings_are_split_between_phrases():
    found = {
        path.relative_to(ROOT).as_posix(): splits
        for path in [*sorted((ROOT / "poollab").rglob("*.py")), ROOT / KNOB_HELP]
        if (splits := mid_phrase_splits(path.read_text(encoding="utf-8")))
    }
    assert found == {}


def test_a_split_mid_phrase_is_found_and_one_between_phrases_is_not():
    code = (
        'A = ("every call up to 20,000 "\n     "events, about 20,000 beyond")\n'
        'B = ("one, "\n     "two (three) "\n     "and four " f"{x}"\n     " five")\n'
        'C = (f"{x} would "\n     f"pick {y}")\n'
    )
    assert mid_phrase_splits(code) == [
        "1: ...every call up to 20,000 |events, about 20,000 beyond...",
        "7: ...{x} would |pick {y}...",
    ]
