"""The dependency rule, read from the imports (``ast``, every import, lazy ones included).

- ``policies`` imports no simpy, CuPy, pandas, nor ``sim``/``traces``/``realgpu``/``poollab``;
- ``traces`` imports no ``policies``, ``sim``, ``realgpu``, ``poollab``;
- ``sim``'s rooms: ``replay`` imports no other room; ``serving`` only ``replay``; ``planner``,
  ``sweep`` and ``report`` build on those (no cycle among rooms, and none among ``sim``'s modules
  at module level);
- ``realgpu`` imports from ``sim`` only the replay room, ``gpu serve`` included (the serving
  columns and presets it shares with ``simulate`` live there; its ``--sim`` comparison is
  ``sim.serving.engine_compare``'s, handed in by the command).

ARCHITECTURE.md explains the rooms.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("replay", "serving", "planner", "sweep", "report")
#: room -> the rooms it may import
ALLOWED = {
    "replay": set(),
    "serving": {"replay"},
    "planner": {"replay", "serving"},
    "sweep": {"replay", "serving"},
    "report": {"replay", "serving", "sweep"},
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, *, module_level_only: bool = False) -> set[str]:
    """Every module ``path`` imports (``from a import b`` counts ``a`` and ``a.b``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    if module_level_only:  # the bodies of module-level if/try (TYPE_CHECKING, optional imports)
        nodes = [
            n
            for top in tree.body
            for n in ast.walk(top)
            if not isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        ]
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.add(module)
            out.update(f"{module}.{a.name}" for a in node.names)
    return out


def modules(package: str) -> dict[str, Path]:
    return {
        module_name(p): p
        for p in sorted((ROOT / package).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "sim" and parts[1] in ROOMS else None


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{m} imports {i}"
        for m, p in modules(package).items()
        for i in imports(p)
        if any(i == f or i.startswith(f + ".") for f in forbidden)
    )


def test_the_rooms_exist():
    missing = [r for r in ROOMS if not (ROOT / "sim" / r / "__init__.py").is_file()]
    assert not missing, f"sim/ has no room {missing}: the layout this test checks is gone"


#: the stdlib-only modules of ``traces`` that ``policies`` shares: the one key=value grammar and the
#: one knob validator (``traces/__init__`` imports no pandas, so importing them pulls none in)
SHARED_WITH_POLICIES = ("traces.spec_grammar", "traces.knobs")


def test_policies_import_no_heavy_library_and_no_other_package():
    found = offenders(
        "policies", ("simpy", "cupy", "pandas", "sim", "traces", "realgpu", "poollab")
    )
    assert [
        f
        for f in found
        if not f.split(" imports ")[1].startswith(tuple(f"{m}" for m in SHARED_WITH_POLICIES))
    ] == []


def test_what_policies_shares_with_traces_imports_only_the_standard_library():
    for name in SHARED_WITH_POLICIES:
        path = ROOT / (name.replace(".", "/") + ".py")
        assert [
            i
            for i in imports(path)
            if i.split(".")[0]
            in (
                "traces",
                "policies",
                "sim",
                "realgpu",
                "poollab",
                "pandas",
                "numpy",
                "simpy",
                "cupy",
            )
        ] == [], name


def test_traces_import_no_policy_and_nothing_built_on_it():
    assert offenders("traces", ("policies", "sim", "realgpu", "poollab")) == []


def test_each_room_imports_only_the_rooms_below_it():
    bad = []
    for m, p in modules("sim").items():
        here = room(m)
        if here is None:
            continue
        for i in imports(p):
            there = room(i)
            if there is not None and there != here and there not in ALLOWED[here]:
                bad.append(f"{m} ({here}) imports {i} ({there})")
    assert not bad, "\n".join(sorted(bad))


def test_realgpu_imports_only_the_replay_room():
    bad = [
        f"{m} imports {i}"
        for m, p in modules("realgpu").items()
        for i in imports(p)
        if i.startswith("sim.") and room(i) != "replay"
    ]
    assert not bad, "\n".join(sorted(bad))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_sims_modules():
    """Module level (TYPE_CHECKING imports included: a type-only circle is still a circle to
    read)."""
    mods = modules("sim")
    graph = {
        m: {
            i
            for i in imports(p, module_level_only=True)
            if i in mods
            and i != m
            and not (i == m.rpartition(".")[0] and mods[i].name == "__init__.py")
        }
        for m, p in mods.items()
    }
    # a package's __init__ re-exporting its own submodules is no circle to read
    graph = {
        m: {i for i in deps if not (mods[m].name == "__init__.py" and i.startswith(m + "."))}
        for m, deps in graph.items()
    }
    found = cycles(graph)
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize(
    "old, new",
    [
        ("sim.engine", "sim.replay.engine"),
        ("sim.simulate", "sim.serving.simulate"),
        ("sim.plots", "sim.report.plots"),
        ("sim.interactive.layout", "sim.replay.layout"),
        ("sim.plots.memory", "sim.report.plots.memory"),
        ("sim.models", "sim.replay.models"),
        ("sim.serving.models", "sim.replay.models"),
        ("sim.serving.hardware", "sim.replay.hardware"),
        ("sim.serving.serving_metrics", "sim.replay.serving_metrics"),
    ],
)
def test_an_old_module_path_imports_the_same_module(old, new):
    import importlib

    assert importlib.import_module(old) is importlib.import_module(new)


def test_the_old_flat_names_stay_importable():
    from sim.replay import replay, trace_events
    from sim.report import summary_row
    from sim.simulate import simulate

    import sim.replay.schema
    import sim.replay.trace_replay
    import sim.serving.simulate

    assert (
        replay is sim.replay.trace_replay.replay
        and trace_events is sim.replay.trace_replay.trace_events
    )
    assert summary_row is sim.replay.schema.summary_row
    assert simulate is sim.serving.simulate.simulate
    with pytest.raises(AttributeError):
        sim.replay.no_such_name  # noqa: B018
