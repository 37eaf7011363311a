"""Compiled best fit (an index of blocks lists alone, no keys: ``BestFit._keyless``) decides what
the interpreted one (keys beside the blocks) decides: the same offsets, failures, stats and free
extents on random operation sequences.

Runs where ``policies.best_fit`` is compiled (``tests/policies/test_compiled.py`` runs this file in
its compiled copy of the tree) against the interpreted modules of the same source in a worker
process: a copy of ``policies`` and ``traces`` without the extension modules. Skipped, saying why,
where ``policies`` is interpreted (the two builds are then the same code).
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies import best_fit
from policies.testing import compiled

COMPILED = not best_fit.__file__.endswith(".py")  # an extension module

pytestmark = pytest.mark.skipif(
    not COMPILED,
    reason="policies.best_fit is interpreted here: tests/policies/test_compiled.py runs this "
    "file against the compiled build",
)

KiB = 1 << 10
MiB = 1 << 20


def decisions(knobs: dict, ops: list) -> dict:
    """Run ``ops`` on a best fit pool made from ``knobs`` and return what it decided. Sent to the
    worker as source: it imports what it needs itself."""
    from policies.best_fit import BestFit

    # offsets from a base (2**62: keys past 63 bits); the worker has this file too
    from tests.policies.test_best_fit_keys import _OffsetDevice

    knobs = dict(knobs)
    base, limit = knobs.pop("base"), knobs.pop("limit_bytes")
    if not knobs.get("virtual"):
        knobs["device"] = _OffsetDevice(base, limit)
    p = BestFit(**knobs)
    live, out = [], []
    for kind, n, stream in ops:
        if kind == "alloc":
            a = p.allocate(n, stream=stream)
            out.append(None if a is None else [a.offset, a.size_bytes])
            if a is not None:
                live.append(a)
        elif kind == "free" and live:
            p.free(live.pop(n % len(live)))
            out.append(p.largest_free_bytes())
        elif kind == "trim":
            out.append(p.trim(n))
        elif kind == "grow":
            out.append(p.grow(n))
    stats = p.stats().as_dict()
    p.check_invariants()
    return {
        "out": out,
        "stats": stats,
        "free_extents": p.free_extents(),
        "segments": [[s.offset, s.nbytes, s.stream] for s in p.segments()],
        "keyless": p._keyless,
    }


WORKER = """
import json, sys
from policies import best_fit
assert best_fit.__file__.endswith(".py") and not best_fit._COMPILED, best_fit.__file__
{source}
for line in sys.stdin:
    knobs, ops = json.loads(line)
    print(json.dumps(decisions(knobs, ops)), flush=True)
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    """A worker process running ``decisions`` on the interpreted modules of this tree."""
    pure = tmp_path_factory.mktemp("pure")
    for package in ("policies", "traces"):  # what ``policies`` imports of this repository
        shutil.copytree(compiled.REPO / package, pure / package, ignore=compiled.COPY_IGNORE)
    keys_tests = "tests/policies/test_best_fit_keys.py"  # ``decisions``' device
    (pure / keys_tests).parent.mkdir(parents=True)
    shutil.copy(compiled.REPO / keys_tests, pure / keys_tests)
    script = WORKER.format(source=inspect.getsource(decisions))
    others = [
        p
        for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
        if p and Path(p).resolve() != compiled.REPO
    ]
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=pure,
        # the pure copy instead of the compiled tree; the rest of the path (a --target install of
        # dependencies, as on the device) stays
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(pure), *others])},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def run(knobs: dict, ops: list) -> dict:
        proc.stdin.write(json.dumps([knobs, ops]) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"the interpreted worker exited ({proc.poll()})"
        return json.loads(line)

    yield run
    proc.stdin.close()
    proc.wait(timeout=30)


_KNOBS = st.fixed_dictionaries(
    {
        "segment_bytes": st.sampled_from([1 * MiB, 2 * MiB]),
        "alignment_bytes": st.sampled_from([256, 512]),
        # 3 KiB: a rounding not a power of two (the generic path)
        "granularity_bytes": st.sampled_from([None, None, 3 * KiB]),
        "split_threshold_bytes": st.sampled_from([None, 8 * KiB]),
        "virtual": st.booleans(),
        "capacity_bytes": st.sampled_from([None, 6 * MiB]),
        "base": st.sampled_from([0, 1 << 40, 1 << 62]),  # 2**62: keys past 63 bits
        "limit_bytes": st.sampled_from([None, 5 * MiB]),
    }
)
_ALLOC = st.tuples(
    st.just("alloc"),
    st.one_of(
        st.integers(1, 64).map(lambda n: n * 256),  # exact fits and splits at the threshold
        st.integers(1, 8 * KiB),
        st.integers(1, 512 * KiB),
        st.integers(1, 3 * MiB),
    ),
    st.sampled_from([0, 0, 0, 7]),
)
_FREE = st.tuples(st.just("free"), st.integers(0, 1 << 16), st.just(0))
# mostly allocations and frees (holes to fit), now and then a trim or a grow
_OP = st.one_of(
    _ALLOC,
    _ALLOC,
    _ALLOC,
    _FREE,
    _FREE,
    st.tuples(st.just("trim"), st.sampled_from([1, 2 * MiB]), st.just(0)),
    st.tuples(st.just("grow"), st.integers(1, 3 * MiB), st.just(0)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(knobs=_KNOBS, ops=st.lists(_OP, min_size=30, max_size=200))
def test_compiled_best_fit_decides_what_the_interpreted_one_does(interpreted, knobs, ops):
    got = json.loads(json.dumps(decisions(knobs, ops)))  # as the worker's JSON gives it
    want = interpreted(knobs, ops)
    assert got.pop("keyless") is True and want.pop("keyless") is False
    assert got == want
