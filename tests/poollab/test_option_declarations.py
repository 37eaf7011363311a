"""Each option that several commands take is declared once, in ``poollab.options``, and every
command's ``--help`` still lists the options it listed before they moved there (issue 32's
leftovers: ``--format`` was written out five times, ``--model``/``--gpu`` six and five)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest

from sim.serving.config import knobs
from tests.poollab.test_options import every_command

ROOT = Path(__file__).resolve().parents[2]
#: The one module where an option several commands take is declared (however many forms it has).
SHARED = "poollab/options.py"
#: Where the ``ServerConfig`` knobs' options come from: each is generated from its ``Knob``.
KNOBS = "the ServerConfig knobs (poollab/commands/simulate.py: config_options)"

#: Option names declared in two places on purpose, and why they are not one option.
SAME_NAME_OTHER_MEANING = {
    "--sample-every": "the replays' is a stride in events (options.sample_every_option); "
    "the simulator's a ServerConfig knob, in seconds",
    "--tp": "calibrate's is the degree the profiled engine ran, "
    "read from the profile when not given; the simulator's a ServerConfig knob, 1 unless given",
    "--max-num-seqs": "gpu serve's goes to the real engine (transformers, default 1024); "
    "the simulator's is a ServerConfig knob",
}

#: Every command's options as ``--help`` listed them before the shared ones moved to
#: ``poollab.options`` (recorded from main at 56287a1 by walking the click commands).
RECORDED = {
    "calibrate requests": "--model --gpu --tp --engine --out --max-evaluations",
    "calibrate steps": "--model --gpu --tp --engine --out --drop --add",
    "colocate": """
        --tenants --layout --policy -p --model --gpu --format --rate-scale --tenant-rate-scale
        --compute --sleep-after --gpu-memory-utilization --kv-capacity --workspace --pool-layout
        --aux-policy --kv-strategy --grow-tokens --tokens-per-page --virtual-page --map-overlap
        --no-map-overlap --map-cache --no-map-cache --prefix-caching --no-prefix-caching
        --prefix-block-tokens --prefix-eviction --hybrid-kv-layout --max-model-len --tp
        --max-num-seqs --max-num-batched-tokens --chunked-prefill --no-chunked-prefill --watermark
        --preemption --swap-space --slo-ttft --slo-tpot --slo-e2e --sample-every --horizon
        --freeze-after-steps --pregrow-safety --compact-between-steps --no-compact-between-steps
        --calibration --costs --out --progress --no-progress
    """,
    "demo": "--out --progress --no-progress",
    "fidelity": "--policy -p --addresses --capacity --device --out --progress --no-progress",
    "gpu calibrate": "--out --device --max-size --vmm --no-vmm",
    "gpu replay": """
        --policy -p --baseline -b --capacity --validate --sim --no-sim --costs --backend
        --device-kind --device --format --sample-every --out --progress --no-progress
    """,
    "gpu serve": """
        --policy -p --model --checkpoint --format --rate-scale --duration --max-requests
        --block-tokens --max-batch-tokens --max-num-seqs --num-blocks --max-memory-percent
        --engine-footprint-check --no-engine-footprint-check --max-len --attn --cuda-graphs
        --no-cuda-graphs --warmup --no-warmup --snapshot --snapshot-until --allocator-mode
        --validate --seed --device --sim --no-sim --gpu --calibration --out
    """,
    "plan": """
        --policy -p --gpu --memory --non-torch --kv --kv-linked --engine --model --block-tokens
        --utilization --device --out --progress --no-progress
    """,
    "replay": """
        --policy -p --capacity --costs --format --sample-every --latency-sample --record-layout
        --workers --out --progress --no-progress
    """,
    "report": "--out --title --static --progress --no-progress",
    "simulate": """
        --policy -p --model --gpu --format --rate-scale --gpu-memory-utilization --kv-capacity
        --workspace --pool-layout --aux-policy --kv-strategy --grow-tokens --tokens-per-page
        --virtual-page --map-overlap --no-map-overlap --map-cache --no-map-cache --prefix-caching
        --no-prefix-caching --prefix-block-tokens --prefix-eviction --hybrid-kv-layout
        --max-model-len --tp --max-num-seqs --max-num-batched-tokens --chunked-prefill
        --no-chunked-prefill --watermark --preemption --swap-space --slo-ttft --slo-tpot --slo-e2e
        --sample-every --horizon --freeze-after-steps --pregrow-safety --compact-between-steps
        --no-compact-between-steps --engine --calibration --costs --out --progress --no-progress
    """,
    "sweep": "--out --scheduler --workers --retry-failed --dry-run --progress --no-progress",
    "traces synth": """
        --rate --num-requests --duration --arrival --cv --prompt --output --prefix-sharing --scale
        --seed --out
    """,
    "traces synth-alloc": """
        --model --num-requests --max-batch --kv-chunk-tokens --rate --seed --out
    """,
}


def _declared_names(call: ast.Call) -> list[str]:
    """The names a ``click.option(...)`` call declares (``--sim/--no-sim``: both); none for a name
    built at run time (an f-string: the knobs' options)."""
    return [
        name
        for arg in call.args
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value[:1] == "-"
        for name in arg.value.split("/")
    ]


def declarations_in(sources: dict[str, str]) -> dict[str, list[str]]:
    """Option name -> the places that declare it, in ``sources`` (path -> code): each
    ``click.option`` call (``path:line``), except that ``SHARED`` is one place."""
    places: dict[str, list[str]] = {}
    for rel, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            func = getattr(node, "func", None)
            if not (
                isinstance(func, ast.Attribute)
                and func.attr == "option"
                and isinstance(func.value, ast.Name)
                and func.value.id == "click"
            ):
                continue
            for name in _declared_names(node):
                where = rel if rel == SHARED else f"{rel}:{node.lineno}"
                if where not in places.setdefault(name, []):
                    places[name].append(where)
    return places


def declarations() -> dict[str, list[str]]:
    """``declarations_in`` every module of ``poollab/``, and the knobs' generated options."""
    sources = {
        path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
        for path in sorted((ROOT / "poollab").rglob("*.py"))
    }
    places = declarations_in(sources)
    for k in knobs().values():
        for name in [f"--{k.cli}"] + ([f"--no-{k.cli}"] if k.type is bool else []):
            places.setdefault(name, []).append(KNOBS)
    return places


def test_each_option_is_declared_in_one_place():
    repeated = {
        name: places
        for name, places in declarations().items()
        if len(places) > 1 and name not in SAME_NAME_OTHER_MEANING
    }
    assert not repeated, f"declare these once, in {SHARED}: {repeated}"


def test_the_names_allowed_twice_are_still_declared_twice():
    places = declarations()
    assert {n for n in SAME_NAME_OTHER_MEANING if len(places.get(n, [])) < 2} == set()


def test_the_check_sees_a_second_declaration_but_not_the_shared_modules_forms():
    code = 'import click\nA = click.option("--format", "fmt")\nB = click.option("--sim/--no-sim")\n'
    places = declarations_in({"poollab/commands/x.py": code, "poollab/commands/y.py": code})
    assert places["--format"] == ["poollab/commands/x.py:2", "poollab/commands/y.py:2"]
    assert places["--no-sim"] == ["poollab/commands/x.py:3", "poollab/commands/y.py:3"]
    shared = declarations_in({SHARED: code + 'C = click.option("--format", "fmt", default=1)\n'})
    assert shared["--format"] == [SHARED]


@pytest.mark.parametrize("command", sorted(RECORDED))
def test_every_command_still_lists_its_options(command, cli_ok):
    out, _ = cli_ok([*command.split(), "--help"])
    missing = [
        name
        for name in RECORDED[command].split()
        if not re.search(rf"(?<![\w-]){name}(?!\w|-\w)", out)
    ]
    assert missing == []


def test_every_result_folder_is_checked_before_any_work():
    """A ``--out`` folder goes through ``options.check_out`` (``plan``'s did not: a folder no run
    can replace failed after the planning)."""
    folders = [
        (path, p)
        for path, cmd in every_command()
        for p in cmd.params
        if "--out" in p.opts and isinstance(p.type, click.Path) and not p.type.file_okay
    ]
    assert len(folders) >= 8
    assert [
        path for path, p in folders if getattr(p.callback, "__name__", None) != "check_out"
    ] == []


def test_plan_refuses_the_current_folder_as_out_before_reading_the_snapshot(
    tmp_path, monkeypatch, cli
):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(["plan", "absent.pickle", "--out", "."])
    assert code == 2 and "current folder" in err and "absent.pickle" not in err
