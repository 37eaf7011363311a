"""SWEEP.yaml: a grid of independent cells, validated before anything runs.

Every list is an axis of the grid (the cells are their product); a scalar is one value::

    mode: replay                        # or simulate
    traces:                             # paths relative to this file, or bundled:NAME (*)
      - ../traces/data/llama1b_generate_slice.pickle.gz
      - {path: prod.csv, format: rmm-log, name: prod}
    policies:
      - first-fit                       # a spec string: one policy
      - {policy: size-class, params: {classes_per_doubling: [2, 4, 8]}}
      - {policy: elastic, params: {base: [best-fit, "size-class:classes_per_doubling=8"], high: [0.8, 0.9]}}
    capacities: [null, 2GiB]            # null: no limit (simulate: the KV budget; null derives it)
    costs: costs.json                   # driver cost model (default: the bundled H200 figures)
    sample_every: 1000                  # replay: stats stride in events
    models: [Llama-3.2-1B]              # simulate: presets or JSON files
    gpus: [H200]                        # simulate
    rate_scales: [1, 2]                 # simulate: arrival-rate multipliers
    options: {kv_strategy: [pow2, grow], max_num_seqs: 128}   # simulate: ServerConfig knobs
    calibration: cal.json               # simulate: step-time calibration
    fingerprint: content                # or stat: key files by path + size + mtime, not a hash
    pareto: {x: overhead, y: [alloc_p99_us, failure_rate]}

Errors name the file, the line and the key: ``sweep.yaml, line 7: policies[1].params.high: ...``.

(*) Relative paths (traces, costs, calibration, model and GPU files) are from the file's folder;
a sweep read from standard input (``cat sweep.yaml | poollab sweep /dev/stdin``, or any
``/dev/fd/N``), which has no folder, takes them from the current directory.

A file is bounded before it is used: nesting at most ``MAX_YAML_DEPTH`` deep (checked while it is
composed), at most ``MAX_YAML_NODES`` nodes with its aliases expanded (counted on the node graph,
so a "billion laughs" is refused without being expanded), and a grid of at most ``MAX_CELLS``
cells (counted from the axes before any cell is built).
"""  # noqa: E501

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass, field
from functools import reduce
from operator import mul
from pathlib import Path
from typing import Any, NoReturn

import yaml

import policies
from policies.spec import format_spec, parse_spec, parse_value
from policies.units import parse_bytes
from sim.replay.schema import SUMMARY_COLUMNS
from sim.sweep.cells import MODES, Cell, FileRef, file_ref
from sim.sweep.errors import SweepSpecError
from traces.source import read_settings_bytes

__all__ = [
    "SweepSpec",
    "load_sweep",
    "parse_sweep",
    "DEFAULT_PARETO_Y",
    "PARETO_BY",
    "MAX_CELLS",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
]

#: Deepest nesting of a SWEEP.yaml: its deepest key (``policies[0].params.base[1]``) is 5 levels;
#: PyYAML composes recursively and runs out of stack near 300.
MAX_YAML_DEPTH = 32
#: Most nodes (keys, values, list items) a SWEEP.yaml may hold with its aliases expanded: a real
#: one has hundreds; ten aliases of ten can stand for 10**10 ("billion laughs").
MAX_YAML_NODES = 100_000
#: Most cells one sweep may have: at a second a cell that is more than a day of one core, and
#: the cells are held in memory; a larger study is several sweeps.
MAX_CELLS = 100_000

_COMMON_KEYS = (
    "name",
    "mode",
    "traces",
    "policies",
    "capacities",
    "costs",
    "fingerprint",
    "pareto",
)
_REPLAY_KEYS = ("sample_every",)
_SIMULATE_KEYS = ("models", "gpus", "rate_scales", "options", "calibration")
_TRACE_KEYS = ("path", "format", "name")
_POLICY_KEYS = ("policy", "params")
#: As ``poollab simulate``'s defaults.
#: The trade-offs the Pareto fronts show against ``overhead`` unless the file says otherwise.
DEFAULT_PARETO_Y = {
    "replay": ["alloc_p99_us", "failure_rate"],
    "simulate": ["ttft_p99_s", "n_preempted"],
}
#: What a front is computed within: the workload, never the choices being compared.
PARETO_BY = {
    "replay": ["trace"],
    "simulate": ["trace", "cell_model", "cell_gpu", "cell_rate_scale"],
}
_SCALARS = (str, int, float, bool, type(None))


@dataclass
class SweepSpec:
    """A parsed SWEEP.yaml: its cells in grid order (traces outermost), duplicates dropped."""

    path: Path
    name: str
    mode: str
    cells: list[Cell]
    pareto_x: str = "overhead"
    pareto_y: list[str] = field(default_factory=list)
    pareto_by: list[str] = field(default_factory=list)
    num_duplicates: int = 0


def load_sweep(path: str | Path) -> SweepSpec:
    """Read and validate a SWEEP.yaml; raises ``SweepSpecError`` (file, line, key, problem)."""
    path = Path(path)
    try:  # read once, whole: a FIFO or /dev/stdin works, /dev/zero is refused
        text = read_settings_bytes(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SweepSpecError(
            path, None, None, f"not UTF-8 text (byte {exc.start}), so not YAML"
        ) from None
    return parse_sweep(text, path, base=relative_base(path))


#: Where a path names an open descriptor, not a file in a folder: ``/dev/stdin``, ``/dev/fd/63``
#: (bash's ``<(...)``), ``/proc/self/fd/0``.
_DESCRIPTOR_FOLDERS = (Path("/dev"), Path("/proc"))


def relative_base(path: str | Path) -> Path:
    """The folder a sweep file's relative paths are from: the file's own, or, for a spec read
    from standard input or another descriptor (``/dev/stdin``, ``/dev/fd/N``: a pipe or a
    redirect, which have no folder), the current directory, as a shell user expects of
    ``cat sweep.yaml | poollab sweep /dev/stdin``. A FIFO made in a folder is a file there."""
    return Path.cwd() if _is_descriptor(path) else Path(path).parent


def _is_descriptor(path: str | Path) -> bool:
    parents = Path(os.path.abspath(path)).parents
    return any(folder in parents for folder in _DESCRIPTOR_FOLDERS)


def _fmt_key(kp: tuple) -> str:
    out = ""
    for part in kp:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Doc:
    """The parsed YAML plus the line of every key, for errors that point into the file."""

    def __init__(self, path: Path, text: str):
        self.path = path
        loader = _BoundedLoader(text, path)
        try:
            node = loader.get_single_node()  # composed once: lines come from this graph, data too
            if node is not None:
                _check_expanded_size(path, node)
            self.data = None if node is None else loader.construct_document(node)
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            reason = " ".join(str(p) for p in (exc.context, exc.problem) if p) or "not valid YAML"
            raise SweepSpecError(
                path, mark.line + 1 if mark else None, None, f"not valid YAML: {reason}"
            ) from None
        except yaml.YAMLError as exc:
            raise SweepSpecError(path, None, None, f"not valid YAML: {exc}") from None
        finally:
            loader.dispose()
        self.lines: dict[tuple, int] = {}
        if node is not None:
            self._index(node, ())

    def _index(self, node: yaml.Node, kp: tuple) -> None:
        self.lines[kp] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in node.value:
                key, line = str(k.value), k.start_mark.line + 1
                if key in seen:  # PyYAML would silently keep the last one
                    raise SweepSpecError(
                        self.path,
                        line,
                        _fmt_key(kp + (key,)),
                        f"given twice (first on line {seen[key]})",
                    )
                seen[key] = line
                self._index(v, kp + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self._index(v, kp + (i,))

    def fail(self, kp: tuple, reason: str) -> NoReturn:
        probe = kp
        while probe and probe not in self.lines:
            probe = probe[:-1]
        line = self.lines.get(probe) if probe else None  # the document's own line says nothing
        raise SweepSpecError(self.path, line, _fmt_key(kp) or None, reason)

    def axis(self, kp: tuple, value: Any) -> list:
        """A list axis (a scalar is a one-value axis); an empty list is an error."""
        values = value if isinstance(value, list) else [value]
        if not values:
            self.fail(kp, "an empty list sweeps nothing; give at least one value")
        return values

    def listed(self, data: dict, key: str, default: Any = None) -> list[tuple[tuple, Any]]:
        """``(key path, value)`` of each value of the top-level axis ``key``."""
        raw = data.get(key, default)
        return [
            ((key, i) if isinstance(raw, list) else (key,), v)
            for i, v in enumerate(self.axis((key,), raw))
        ]


class _BoundedLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses nesting deeper than ``MAX_YAML_DEPTH`` as it composes (before
    the composer's recursion could exhaust Python's stack)."""

    def __init__(self, text: str, path: Path):
        super().__init__(text)
        self._path, self._depth = path, 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise SweepSpecError(
                    self._path,
                    mark.line + 1,
                    None,
                    f"nested more than {MAX_YAML_DEPTH} levels deep "
                    "(the deepest key of a sweep is 5)",
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_expanded_size(path: Path, root: yaml.Node) -> None:
    """Refuse a document whose aliases expand past ``MAX_YAML_NODES`` nodes or ``MAX_YAML_DEPTH``
    levels, or that contains itself (``&a [*a]``), from the node graph alone: an aliased node is
    one object, so the walk visits each once (iteratively: the expanded depth is not yet known)."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            depth[key] = 1 + max((depth[id(k)] for k in kids), default=0)
            on_path.discard(key)
            continue
        if key in size:
            continue
        if key in on_path:  # reached again below itself
            raise SweepSpecError(
                path,
                node.start_mark.line + 1,
                None,
                "an alias refers to a node that contains it, so it never ends",
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node) if id(k) not in size)
    nodes = {id(n): n for n in _walk_once(root)}
    if size[id(root)] > MAX_YAML_NODES:
        # the smallest node past the limit is where the aliases multiply
        worst = min(
            (n for k, n in nodes.items() if size[k] > MAX_YAML_NODES), key=lambda n: size[id(n)]
        )
        raise SweepSpecError(
            path,
            worst.start_mark.line + 1,
            None,
            f"with its aliases expanded this holds {size[id(worst)]:,} values, "
            f"more than {MAX_YAML_NODES:,} (the whole file: {size[id(root)]:,})",
        )
    if depth[id(root)] > MAX_YAML_DEPTH:
        raise SweepSpecError(
            path,
            None,
            None,
            f"with its aliases expanded the file nests {depth[id(root)]:,} levels deep, "
            f"more than {MAX_YAML_DEPTH}",
        )


def _walk_once(root: yaml.Node) -> list[yaml.Node]:
    """Every distinct node of the graph, once each (aliases not followed twice)."""
    seen, out, stack = set(), [], [root]
    while stack:
        node = stack.pop()
        if id(node) not in seen:
            seen.add(id(node))
            out.append(node)
            stack.extend(_children(node))
    return out


def _num_cells(data: dict, mode: str) -> int:
    """Cells the grid will have before duplicates are dropped, from the lengths of its axes
    (what is malformed counts as one value: it is reported once the axes are read)."""

    def num_values(value: Any) -> int:
        return len(value) if isinstance(value, list) else 1

    def product(values: Any) -> int:
        return reduce(mul, (num_values(v) for v in values), 1)

    items = data.get("policies")
    num_policies = sum(
        product(item["params"].values())
        if isinstance(item, dict) and isinstance(item.get("params"), dict)
        else 1
        for item in (items if isinstance(items, list) else [items])
    )
    cells = num_values(data.get("traces")) * num_policies * num_values(data.get("capacities"))
    if mode == "simulate":
        options = data.get("options")
        cells *= product([data.get("models"), data.get("gpus"), data.get("rate_scales")])
        cells *= product(options.values()) if isinstance(options, dict) else 1
    return cells


def parse_sweep(text: str, path: str | Path = "<sweep>", *, base: Path | None = None) -> SweepSpec:
    """Validate ``text`` (the content of ``path``, which errors name); relative paths in it are
    from ``base`` (default: ``path``'s folder; ``load_sweep`` passes ``relative_base(path)``)."""
    path = Path(path)
    doc = _Doc(path, text)
    data = doc.data
    if not isinstance(data, dict):
        doc.fail((), "expected a mapping with at least 'traces' and 'policies'")
    mode = data.get("mode", "replay")
    if mode not in MODES:
        doc.fail(("mode",), f"{mode!r} is not a mode; choose one of {', '.join(MODES)}")
    known = _COMMON_KEYS + (_REPLAY_KEYS if mode == "replay" else _SIMULATE_KEYS)
    for key in data:
        if key in _SIMULATE_KEYS + _REPLAY_KEYS and key not in known:
            doc.fail((str(key),), f"only for mode: {'simulate' if mode == 'replay' else 'replay'}")
        if key not in known:
            doc.fail((str(key),), f"unknown key; known keys for mode {mode}: {', '.join(known)}")
    for key in ("traces", "policies"):
        if key not in data:
            doc.fail((), f"missing key {key!r}")
    num_cells = _num_cells(data, mode)
    if num_cells > MAX_CELLS:
        doc.fail(
            (),
            f"the grid has {num_cells:,} cells, more than {MAX_CELLS:,}; "
            "sweep fewer values, or split it into several sweeps",
        )
    how = data.get("fingerprint", "content")
    if how not in ("content", "stat"):
        doc.fail(
            ("fingerprint",),
            f"{how!r} must be 'content' (hash the files) or 'stat' (path, size, mtime)",
        )
    base = path.parent if base is None else base

    traces = _traces(doc, doc.listed(data, "traces"), base, mode, how)
    specs = _policies(doc, doc.listed(data, "policies"))
    capacities = [_capacity(doc, kp, v) for kp, v in doc.listed(data, "capacities")]
    costs = _costs(doc, data.get("costs"), base, how)
    pareto_x, pareto_y = _pareto(doc, data.get("pareto"), mode)
    common = dict(costs=costs)
    if mode == "replay":
        sample_every = data.get("sample_every")
        if sample_every is not None and (
            isinstance(sample_every, bool) or not isinstance(sample_every, int) or sample_every < 1
        ):
            doc.fail(
                ("sample_every",), f"{sample_every!r} must be a positive whole number of events"
            )
        grid = [dict(capacity_bytes=cap, sample_every=sample_every) for cap in capacities]
    else:
        grid = _simulate_grid(doc, data, base, how, capacities)
    cells, seen = [], set()
    for (tref, tname, tfmt), spec, extra in itertools.product(traces, specs, grid):
        cell = Cell(mode, tref, tname, tfmt, spec, **common, **extra)
        if cell.key not in seen:
            seen.add(cell.key)
            cells.append(cell)
    name = data.get("name", path.stem)
    if not isinstance(name, str):
        doc.fail(("name",), f"{name!r} must be a string")
    return SweepSpec(
        path=path,
        name=name,
        mode=mode,
        cells=cells,
        pareto_x=pareto_x,
        pareto_y=pareto_y,
        pareto_by=list(PARETO_BY[mode]),
        num_duplicates=len(traces) * len(specs) * len(grid) - len(cells),
    )


def _resolve(doc: _Doc, kp: tuple, value: Any, base: Path) -> Path:
    if not isinstance(value, str) or not value.strip():
        doc.fail(kp, f"{value!r} must be a file path")
    if value.startswith("bundled:"):
        from traces import bundled_path

        try:
            return bundled_path(value[len("bundled:") :])
        except FileNotFoundError as exc:
            doc.fail(kp, str(exc))
    p = Path(value).expanduser()
    relative = not p.is_absolute()
    p = base / p if relative else p
    _refuse_stream(doc, kp, p)
    if not p.is_file():
        note = (
            f" (a relative path in a sweep read from {doc.path} is from the current directory)"
            if relative and _is_descriptor(doc.path)
            else ""
        )
        doc.fail(kp, f"no such file: {p}{note}")
    return p.resolve()


def _refuse_stream(doc: _Doc, kp: tuple, p: Path) -> None:
    """A pipe, FIFO or device named in the file fails here: each cell's worker reads its files
    again, and the store hashes them, which a stream (read once) cannot give."""
    if p.exists() and not p.is_file() and not p.is_dir():
        doc.fail(kp, f"not a regular file (a pipe, FIFO or device): {p}; write it to a file")


def _default_trace_name(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".pickle", ".pkl", ".csv", ".parquet", ".pq", ".jsonl", ".json", ".log"):
        name = name.removesuffix(suffix)
    return name or path.name


def _traces(
    doc: _Doc, items: list[tuple[tuple, Any]], base: Path, mode: str, how: str
) -> list[tuple[FileRef, str, str]]:
    from traces import TraceFormatError
    from traces.formats import ALLOC, REQUEST

    registry = ALLOC if mode == "replay" else REQUEST
    formats, detect = registry.names(), registry.detect
    out, names = [], {}
    for i, (kp, item) in enumerate(items):
        entry = {"path": item} if isinstance(item, str) else item
        if not isinstance(entry, dict):
            doc.fail(kp, f"{item!r} must be a path or a mapping with 'path' (and 'format', 'name')")
        for key in entry:
            if key not in _TRACE_KEYS:
                doc.fail(kp + (str(key),), f"unknown key; a trace has {', '.join(_TRACE_KEYS)}")
        if "path" not in entry:
            doc.fail(kp, "missing key 'path'")
        path = _resolve(doc, kp + ("path",) if isinstance(item, dict) else kp, entry["path"], base)
        fmt = entry.get("format")
        if fmt is None:
            try:
                fmt = detect(path)
            except (TraceFormatError, ValueError) as exc:
                kind = "an allocation" if mode == "replay" else "a request"
                doc.fail(kp, f"not {kind} trace: {' '.join(str(exc).split())}")
        elif fmt not in formats:
            doc.fail(
                kp + ("format",),
                f"{fmt!r} is not a {mode} trace format; choose one of {', '.join(formats)}",
            )
        name = entry.get("name") or _default_trace_name(path)
        if not isinstance(name, str):
            doc.fail(kp + ("name",), f"{name!r} must be a string")
        if name in names:  # fronts and tables are per trace name
            doc.fail(
                kp,
                f"trace name {name!r} is also traces[{names[name]}]'s; give one of them a 'name'",
            )
        names[name] = i
        out.append((file_ref(path, how), name, fmt))
    return out


def _spec_value(value: Any) -> Any:
    return parse_value(value) if isinstance(value, str) else value


def _policies(doc: _Doc, items: list[tuple[tuple, Any]]) -> list[str]:
    specs: list[str] = []
    for kp, item in items:
        if isinstance(item, str):
            variants = [(kp, item, {})]
        elif isinstance(item, dict):
            for key in item:
                if key not in _POLICY_KEYS:
                    doc.fail(
                        kp + (str(key),),
                        f"unknown key; a policy entry has {', '.join(_POLICY_KEYS)}",
                    )
            if not isinstance(item.get("policy"), str):
                doc.fail(
                    kp + ("policy",), f"{item.get('policy')!r} must be a policy name or spec string"
                )
            params = item.get("params") or {}
            if not isinstance(params, dict):
                doc.fail(
                    kp + ("params",),
                    f"{params!r} must be a mapping of parameter: value or [values]",
                )
            axes = []
            for k, v in params.items():
                pk = kp + ("params", str(k))
                if not isinstance(k, str) or not k.isidentifier():
                    doc.fail(pk, "is not a parameter name")
                values = doc.axis(pk, v)
                for j, x in enumerate(values):
                    if not isinstance(x, _SCALARS):
                        doc.fail(
                            pk + ((j,) if isinstance(v, list) else ()),
                            f"{x!r} must be a number, string, boolean or null "
                            "(a nested policy is a spec string, "
                            "e.g. 'size-class:classes_per_doubling=8')",
                        )
                axes.append((k, values))
            variants = [
                (kp, item["policy"], dict(zip([k for k, _ in axes], combo)))
                for combo in itertools.product(*[vals for _, vals in axes])
            ]
        else:
            doc.fail(kp, f"{item!r} must be a spec string or a mapping with 'policy' and 'params'")
        for where, text, extra in variants:
            try:
                name, fixed = parse_spec(text)
                both = sorted(set(fixed) & set(extra))
                if both:
                    doc.fail(where + ("params", both[0]), f"also set in the spec {text!r}")
                spec = format_spec(name, {**fixed, **{k: _spec_value(v) for k, v in extra.items()}})
                policies.create(spec)  # unknown names and knobs, bad values: now, not in a worker
            except policies.PolicyError as exc:
                combo = ", ".join(f"{k}={v}" for k, v in extra.items())
                # with knobs from the file, the spec built is not one the user wrote: say theirs
                doc.fail(where, f"{text} with {combo}: {exc.reason}" if combo else str(exc))
            specs.append(spec)
    return specs


def _capacity(doc: _Doc, kp: tuple, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        doc.fail(kp, f"{value!r} must be a size (4096, 2GiB) or null for no limit")
    try:
        nbytes = parse_bytes(value if isinstance(value, (int, str)) else repr(value))
    except policies.PolicyError as exc:
        doc.fail(kp, str(exc))
    if nbytes <= 0:
        doc.fail(kp, f"{value!r} must be > 0 (null means no limit)")
    return nbytes


def _costs(doc: _Doc, value: Any, base: Path, how: str) -> FileRef | None:
    if value is None:
        return None
    from sim.replay.costs import CostModel

    path = _resolve(doc, ("costs",), value, base)
    try:
        CostModel.load(path)
    except ValueError as exc:
        doc.fail(("costs",), str(exc))
    return file_ref(path, how)


def _preset_or_file(doc: _Doc, kp: tuple, value: Any, base: Path, how: str, load) -> str | FileRef:
    if not isinstance(value, str):
        doc.fail(kp, f"{value!r} must be a preset name or a JSON file")
    candidate = Path(value).expanduser()
    candidate = candidate if candidate.is_absolute() else base / candidate
    _refuse_stream(doc, kp, candidate)
    target = candidate if candidate.is_file() else value
    try:
        spec = load(target)
    except ValueError as exc:
        doc.fail(kp, " ".join(str(exc).split()))
    return file_ref(candidate, how) if target is candidate else spec.name


def _simulate_grid(
    doc: _Doc, data: dict, base: Path, how: str, capacities: list
) -> list[dict[str, Any]]:
    from sim.replay.hardware import DEFAULT_GPU, load_gpu
    from sim.replay.models import DEFAULT_MODEL, load_model
    from sim.serving.config import ServerConfig, knobs
    from sim.serving.steptime import load_calibration

    models = [
        _preset_or_file(doc, kp, v, base, how, load_model)
        for kp, v in doc.listed(data, "models", DEFAULT_MODEL)
    ]
    gpus = [
        _preset_or_file(doc, kp, v, base, how, load_gpu)
        for kp, v in doc.listed(data, "gpus", DEFAULT_GPU)
    ]
    rates = []
    for kp, v in doc.listed(data, "rate_scales", 1.0):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            doc.fail(kp, f"{v!r} must be a finite number > 0")
        rates.append(float(v))
    calibration = None
    if data.get("calibration") is not None:
        path = _resolve(doc, ("calibration",), data["calibration"], base)
        try:
            load_calibration(path)
        except ValueError as exc:
            doc.fail(("calibration",), str(exc))
        calibration = file_ref(path, how)

    options = data.get("options") or {}
    if not isinstance(options, dict):
        doc.fail(
            ("options",), f"{options!r} must be a mapping of simulator option: value or [values]"
        )
    known = knobs()
    axes = []
    for k, v in options.items():
        kp = ("options", str(k))
        if k not in known:
            doc.fail(kp, f"unknown simulator option; options: {', '.join(known)}")
        if k == "kv_capacity_bytes" and "capacities" in data:
            doc.fail(kp, "the KV budget is swept by 'capacities'; give it in one place")
        values = doc.axis(kp, v)
        if known[k].unit == "bytes":
            values = [_capacity(doc, kp, x) for x in values]
        for x in values:
            if not isinstance(x, _SCALARS):
                doc.fail(kp, f"{x!r} must be a number, string, boolean or null")
        axes.append((k, values))
    combos = [
        tuple(sorted(zip([k for k, _ in axes], combo)))
        for combo in itertools.product(*[v for _, v in axes])
    ]
    for combo in combos:
        try:
            ServerConfig.from_kwargs(**dict(combo))
        except (TypeError, ValueError) as exc:
            doc.fail(("options",), str(exc))
    return [
        dict(capacity_bytes=cap, model=m, gpu=g, rate_scale=r, options=o, calibration=calibration)
        for cap, m, g, r, o in itertools.product(capacities, models, gpus, rates, combos)
    ]


def _pareto(doc: _Doc, value: Any, mode: str) -> tuple[str, list[str]]:
    from sim.replay.serving_metrics import SERVING_COLUMNS

    columns = SUMMARY_COLUMNS + (SERVING_COLUMNS if mode == "simulate" else [])
    value = {} if value is None else value
    if not isinstance(value, dict):
        doc.fail(("pareto",), f"{value!r} must be a mapping with 'x' and 'y'")
    for key in value:
        if key not in ("x", "y"):
            doc.fail(
                ("pareto", str(key)),
                "unknown key; pareto has x (memory) and y (a metric or a list)",
            )
    x = value.get("x", "overhead")
    ys = value.get("y", DEFAULT_PARETO_Y[mode])
    ys = ys if isinstance(ys, list) else [ys]
    for kp, col in [(("pareto", "x"), x)] + [(("pareto", "y"), y) for y in ys]:
        if col not in columns:
            doc.fail(kp, f"{col!r} is not a report column; columns: {', '.join(columns)}")
    return x, ys
