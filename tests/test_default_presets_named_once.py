"""The default model and GPU are named once: ``sim.replay.models.DEFAULT_MODEL`` and
``sim.replay.hardware.DEFAULT_GPU``. Every other default takes the constant, so changing the default
is one edit.

Read from the code (``ast``: string constants, not prose; docstrings and comments may say the
name) of every Python module and notebook code cell outside ``tests/`` (a test names the preset it
checks). Shell scripts are left out: they name the model a recorded run used, and ``plan --model``
has no default to repeat.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

from sim.replay.hardware import DEFAULT_GPU
from sim.replay.models import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {
    "tests",
    ".git",
    "build",
    "dist",
    ".venv",
    "node_modules",
    "__pycache__",
    ".hypothesis",
}
#: (file, name assigned): where the name is a fact about a recording, not a default, and why
NOT_A_DEFAULT = {
    ("sim/replay/models.py", "DEFAULT_MODEL"): "the one place",
    ("sim/replay/hardware.py", "DEFAULT_GPU"): "the one place",
    ("benchmarks/steptime/validate.py", "GRID_MODEL"): "the shape measure_grid.py measured",
}


def _sources() -> list[tuple[str, str]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")) + sorted(ROOT.rglob("*.ipynb")):
        rel = path.relative_to(ROOT)
        if SKIP_DIRS & set(rel.parts[:-1]) or rel.parts[0].startswith("."):
            continue
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".ipynb":
            cells = [c for c in json.loads(text)["cells"] if c["cell_type"] == "code"]
            # magics (%, !) are not Python; a notebook's cells run as one module here
            text = "\n".join(
                "" if line.lstrip().startswith(("%", "!")) else line
                for c in cells
                for line in "".join(c["source"]).splitlines()
            )
        out.append((rel.as_posix(), text))
    return out


def literal_defaults(rel: str, text: str, names: set[str]) -> list[str]:
    """``file:line`` of each string constant equal (case aside) to one of ``names``, except the
    value assigned to a ``NOT_A_DEFAULT`` name of that file."""
    tree = ast.parse(text, filename=rel)
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = [
                t.id
                for target in node.targets
                for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                if isinstance(t, ast.Name)
            ]
            if any((rel, t) in NOT_A_DEFAULT for t in targets):
                allowed.update(id(n) for n in ast.walk(node.value))
    wanted = {n.lower() for n in names}
    return [
        f"{rel}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value.lower() in wanted
        and id(node) not in allowed
    ]


def test_the_default_model_and_gpu_are_written_only_where_they_are_defined():
    found = [
        hit
        for rel, text in _sources()
        for hit in literal_defaults(rel, text, {DEFAULT_MODEL, DEFAULT_GPU})
    ]
    assert not found, (
        "write DEFAULT_MODEL/DEFAULT_GPU (sim.replay.models/hardware), not the name:\n"
        + "\n".join(found)
    )


def test_the_finder_sees_a_literal_default_and_lets_the_definition_be():
    code = 'DEFAULT_MODEL = "Llama-3-8B"\ndef f(model="llama-3-8b", gpu=DEFAULT_GPU): ...\n'
    assert literal_defaults("sim/replay/models.py", code, {"Llama-3-8B"}) == [
        "sim/replay/models.py:2: 'llama-3-8b'"
    ]
    assert literal_defaults("x.py", '"""Llama-3-8B on an H200."""', {"Llama-3-8B"}) == []
