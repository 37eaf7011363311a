"""``sim.planner.plan``: the largest KV cache with which an engine's recorded start-up still fits,
exact to one page."""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path

import pytest

from sim.replay.fidelity import read_recording, snapshot_to_recording
from sim.planner.plan import (
    PLAN_COLUMNS,
    PlanError,
    fits,
    parse_kv_linked,
    parse_kv_selector,
    plan,
    plan_inputs,
    planned_budgets,
    read_plan,
    recognise_kv,
    select_kv,
    write_plan,
)
from traces.errors import TraceFormatError
from traces.pytorch_snapshot import parse_snapshot

MiB = 1 << 20
SNAPSHOTS = Path(__file__).resolve().parents[2] / "data" / "snapshots_h200"


def startup_snapshot(
    *,
    weights=(100 * MiB,),
    pre_trace_weights=(),
    profiling=(),
    num_kv=2,
    kv_bytes=128 * MiB,
    warmup=(50 * MiB,),
    small_between_kv=0,
    linked=(),
) -> dict:
    """A start-up snapshot laid out as ``torch.cuda.memory._snapshot()`` does: weights (allocated in
    the trace, or ``pre_trace_weights`` as blocks of the final ``segments`` never seen allocated), a
    profiling run (allocations freed again), ``num_kv`` KV tensors in one burst
    (``small_between_kv`` small allocations after each, as views and scales would be), ``linked``
    buffers allocated after the cache and never freed (an attention mask sized by it), then warm-up
    steps (alloc, free)."""
    entries, t, addr = [], [0], [1 << 40]

    def alloc(size: int) -> int:
        a = addr[0]
        addr[0] += size + (2 * MiB)  # never reused: every address names one allocation
        t[0] += 10
        entries.append({"action": "alloc", "addr": a, "size": size, "stream": 0, "time_us": t[0]})
        return a

    def free(a: int, size: int) -> None:
        t[0] += 10
        for action in ("free_requested", "free_completed"):
            entries.append(
                {"action": action, "addr": a, "size": size, "stream": 0, "time_us": t[0]}
            )

    for size in weights:
        alloc(size)
    for size in profiling:
        free(alloc(size), size)
    for _ in range(num_kv):
        alloc(kv_bytes)
        for _ in range(small_between_kv):
            alloc(4096)
    for size in linked:
        alloc(size)
    for size in warmup:
        free(alloc(size), size)
    segments, seg_addr = [], 1 << 30
    for size in pre_trace_weights:
        segments.append(
            {
                "device": 0,
                "address": seg_addr,
                "total_size": size,
                "allocated_size": size,
                "stream": 0,
                "segment_type": "large",
                "blocks": [
                    {
                        "address": seg_addr,
                        "size": size,
                        "requested_size": size,
                        "state": "active_allocated",
                    }
                ],
            }
        )
        seg_addr += size
    return {
        "segments": segments,
        "device_traces": [entries],
        "allocator_settings": {"expandable_segments": False, "max_split_size": -1},
    }


def recording(snap: dict, name: str = "startup"):
    return snapshot_to_recording(parse_snapshot(snap, source=f"{name}.pickle", name=name))


def write(tmp_path: Path, snap: dict, name: str = "startup.pickle.gz") -> Path:
    path = tmp_path / name
    path.write_bytes(gzip.compress(pickle.dumps(snap, protocol=4), mtime=0))
    return path


def brute_force_safe_pages(inputs, spec: str, up_to: int) -> int:
    """The largest page count that fits, trying every count from 1 (0 when none does)."""
    fitting = [n for n in range(1, up_to) if fits(inputs, spec, n).fits]
    assert fitting != list(range(1, up_to)) or not fitting, "raise up_to: every size tried fits"
    return max(fitting, default=0)


# ------------------------------------------------------------------------- recognising the KV cache
def test_the_kv_cache_is_the_burst_of_equal_size_allocations_that_live_to_the_end():
    rec = recording(
        startup_snapshot(weights=(20 * MiB,), num_kv=6, kv_bytes=8 * MiB, small_between_kv=1)
    )
    kv = recognise_kv(rec)
    assert len(kv.ops) == 6 and kv.nbytes == 8 * MiB and kv.total_bytes == 48 * MiB
    assert [rec.sizes[k] for k in kv.ops] == [8 * MiB] * 6
    assert "6 x 8.0 MiB" in kv.how and "one burst" in kv.how


def test_weights_of_one_shape_in_every_layer_are_no_burst():
    # four layers of (q, k, v, o, gate, up, down): k and v share a shape, and the rest recur per
    # layer
    layer = (16 * MiB, 4 * MiB, 4 * MiB, 16 * MiB, 56 * MiB, 56 * MiB, 56 * MiB)
    rec = recording(startup_snapshot(weights=layer * 4, num_kv=8, kv_bytes=100 * MiB, warmup=()))
    kv = recognise_kv(rec)
    assert (
        len(kv.ops) == 8 and kv.nbytes == 100 * MiB
    )  # gate, up, down (3 x 56 MiB a layer) are a burst, but smaller


def test_one_big_tensor_is_a_kv_cache_too():
    kv = recognise_kv(
        recording(startup_snapshot(weights=(10 * MiB,), num_kv=1, kv_bytes=600 * MiB))
    )
    assert len(kv.ops) == 1 and kv.nbytes == 600 * MiB


def test_two_equal_candidates_are_refused_with_one_line_naming_both():
    # the weights (one 100 MiB tensor) and, after a profiling run, a KV tensor of 100 MiB: nothing
    # tells which is the cache
    rec = recording(
        startup_snapshot(
            weights=(100 * MiB,), profiling=(30 * MiB, 20 * MiB), num_kv=1, kv_bytes=100 * MiB
        )
    )
    with pytest.raises(PlanError, match=r"cannot tell the KV cache apart: 1 x 100\.0 MiB .* --kv"):
        recognise_kv(rec)


def test_no_allocation_living_to_the_end_is_refused():
    rec = recording(startup_snapshot(weights=(), num_kv=0, warmup=(5 * MiB,)))
    with pytest.raises(PlanError, match="no allocation made in the trace lives to the end"):
        recognise_kv(rec)


def test_a_cache_allocated_before_recording_began_is_refused_not_mistaken():
    # the ring buffer lost the KV allocation: 8 x 200 MiB are blocks live at the start, and the
    # trace's own never-freed allocations are small leftovers
    rec = recording(
        startup_snapshot(
            weights=(8 * MiB,), pre_trace_weights=(200 * MiB,) * 8, num_kv=1, kv_bytes=20 * MiB
        )
    )
    with pytest.raises(
        PlanError, match=r"8 x 200\.0 MiB \(1\.6 GiB\) were live before recording began.*--kv"
    ):
        recognise_kv(rec)
    assert len(select_kv(rec, [parse_kv_selector("size=20MiB")]).ops) == 1  # named, it is planned


def test_the_user_names_the_kv_by_size_entries_or_address():
    snap = startup_snapshot(
        weights=(100 * MiB,), profiling=(30 * MiB, 20 * MiB), num_kv=1, kv_bytes=100 * MiB
    )
    rec = recording(snap)
    kv_entry = rec.entries[[k for k, s in enumerate(rec.sizes) if s == 100 * MiB][1]]
    kv_addr = snap["device_traces"][0][kv_entry]["addr"]
    by_entry = select_kv(rec, [parse_kv_selector(f"entries={kv_entry}")])
    by_addr = select_kv(rec, [parse_kv_selector(f"addr={kv_addr:#x}")])
    assert by_entry.ops == by_addr.ops and len(by_entry.ops) == 1
    assert rec.entries[by_entry.ops[0]] == kv_entry
    assert len(select_kv(rec, [parse_kv_selector("size=100MiB")]).ops) == 2  # both live to the end
    # a range takes the never-freed allocations in it: the profiling run's before the cache is left
    # out
    assert select_kv(rec, [parse_kv_selector(f"entries=1-{kv_entry + 5}")]).ops == by_entry.ops


@pytest.mark.parametrize(
    "text, words",
    [
        ("weights", "expected size=SIZE"),
        ("size=lots", "'lots' is not a valid size"),
        ("entries=9-3", "not a valid entries"),
    ],
)
def test_bad_selectors_say_what_is_wrong(text, words):
    with pytest.raises(PlanError, match=words):
        parse_kv_selector(text)


def test_a_selector_naming_a_freed_or_missing_allocation_is_refused():
    rec = recording(startup_snapshot(profiling=(30 * MiB,)))
    freed_entry = rec.entries[next(k for k, s in enumerate(rec.sizes) if s == 30 * MiB)]
    with pytest.raises(PlanError, match="is freed during the trace"):
        select_kv(rec, [parse_kv_selector(f"entries={freed_entry}")])
    with pytest.raises(PlanError, match="no allocation of the trace that lives to the end matches"):
        select_kv(rec, [parse_kv_selector("size=3MiB")])
    with pytest.raises(PlanError, match="no allocation made in the trace at 0x10"):
        select_kv(rec, [parse_kv_selector("addr=0x10")])


# -------------------------------------------------------------------- weights and the profiled peak
def test_weights_are_what_lives_to_the_end_from_before_the_kv_cache_pre_trace_blocks_included():
    rec = recording(
        startup_snapshot(
            weights=(40 * MiB,), pre_trace_weights=(60 * MiB,), profiling=(30 * MiB, 20 * MiB)
        )
    )
    inputs = plan_inputs(rec, device_bytes=1 << 30)
    assert inputs.weights_bytes == 100 * MiB
    assert (
        inputs.profiled_peak_bytes == 30 * MiB
    )  # the profiling allocations are freed one after the other


# ---------------------------------------------------------------------------- the search is exact
def test_the_plan_is_the_largest_kv_that_fits_worked_by_hand():
    # torch-caching gives each >= 10 MiB request its own segment: 100 MiB of weights, two KV tensors
    # of 2 MiB a page each (a page is 4 MiB), a 50 MiB warm-up step after: 100 + 4 n + 50 <= 1024
    rec = recording(startup_snapshot(weights=(100 * MiB,), num_kv=2, warmup=(50 * MiB,)))
    result = plan(rec, ["torch-caching"], device_bytes=1024 * MiB)
    row = result.table().iloc[0]
    assert (
        row.safe_kv_pages == 218
        and row.safe_kv_bytes == 218 * 4 * MiB
        and row.page_bytes == 4 * MiB
    )
    assert row.peak_reserved_bytes == 1022 * MiB and row.margin_bytes == 2 * MiB
    assert row.peak_non_kv_reserved_bytes == 150 * MiB and row.weights_bytes == 100 * MiB
    assert row.frag_at_peak == 0  # nothing cached at the peak: the warm-up step's segment is live
    plan_1 = result.plans[0]
    assert plan_1.next_page.oom_op == max(
        range(len(rec.ops)), key=lambda k: rec.sizes[k] == 50 * MiB
    )


@pytest.mark.parametrize("spec", ["torch-caching", "best-fit", "first-fit", "size-class"])
def test_the_search_finds_what_trying_every_size_finds(spec):
    rec = recording(
        startup_snapshot(
            weights=(70 * MiB, 30 * MiB, 3 * MiB),
            profiling=(90 * MiB, 40 * MiB, 300 * 1024),
            num_kv=4,
            kv_bytes=40 * MiB,
            small_between_kv=1,
            warmup=(120 * MiB, 7 * MiB, 45 * MiB),
        )
    )
    result = plan(rec, [spec], device_bytes=512 * MiB)
    inputs, p = result.inputs, result.plans[0]
    assert p.safe_pages == brute_force_safe_pages(
        inputs, spec, inputs.capacity_bytes // inputs.page_bytes + 2
    )
    assert p.safe_pages > 0 and not p.next_page.fits
    assert (
        p.num_replays < inputs.capacity_bytes // inputs.page_bytes
    )  # fewer replays than trying every size


# -------------------------------------------------------------------- buffers sized by the KV cache
def test_a_linked_buffer_grows_with_the_kv_worked_by_hand():
    # as test_the_plan_is_the_largest_kv_that_fits_worked_by_hand, plus a 20 MiB buffer after the
    # cache that grows 2 MiB a page (recorded at 64 pages): 100 + 4 n + (20 + 2 (n - 64)) + 50 <=
    # 1024, so n = 163
    rec = recording(
        startup_snapshot(
            weights=(100 * MiB,),
            num_kv=2,
            kv_bytes=128 * MiB,
            linked=(20 * MiB,),
            warmup=(50 * MiB,),
        )
    )
    mask = next(k for k, s in enumerate(rec.sizes) if s == 20 * MiB)
    result = plan(
        rec,
        ["torch-caching"],
        device_bytes=1024 * MiB,
        kv_linked=[parse_kv_linked(f"entries={rec.entries[mask]}:2MiB")],
    )
    inputs, row = result.inputs, result.table().iloc[0]
    assert inputs.sizes_for(164)[mask] == (20 + 2 * 100) * MiB
    assert (
        row.safe_kv_pages == 163
        and row.kv_linked_bytes == 218 * MiB
        and row.num_kv_linked_allocs == 1
    )
    assert row.peak_reserved_bytes == (100 + 4 * 163 + 218 + 50) * MiB
    assert result.plans[0].next_page.oom_op is not None
    unlinked = plan(rec, ["torch-caching"], device_bytes=1024 * MiB).table().iloc[0]
    assert (
        unlinked.safe_kv_pages == 213 and unlinked.kv_linked_bytes == 0
    )  # 100 + 4 n + 20 + 50 <= 1024


@pytest.mark.parametrize("spec", ["torch-caching", "best-fit", "size-class"])
def test_with_a_linked_buffer_the_search_finds_what_trying_every_size_finds(spec):
    rec = recording(
        startup_snapshot(
            weights=(70 * MiB, 3 * MiB),
            profiling=(90 * MiB,),
            num_kv=4,
            kv_bytes=40 * MiB,
            small_between_kv=1,
            linked=(9 * MiB, 5 * MiB),
            warmup=(120 * MiB, 45 * MiB),
        )
    )
    result = plan(
        rec,
        [spec],
        device_bytes=512 * MiB,
        kv_linked=[parse_kv_linked("size=9MiB:3MiB"), parse_kv_linked("size=5MiB:700KiB")],
    )
    inputs, p = result.inputs, result.plans[0]
    assert inputs.num_linked_allocs == 2
    assert p.safe_pages == brute_force_safe_pages(
        inputs, spec, inputs.capacity_bytes // inputs.page_bytes + 2
    )
    assert p.safe_pages > 0 and not p.next_page.fits
    unlinked = plan(rec, [spec], device_bytes=512 * MiB).plans[0]
    assert unlinked.safe_pages > p.safe_pages


def test_an_engine_rule_recognises_its_buffer_and_needs_a_model():
    from sim.serving.engines import EnginePreset, KvLinkedRule

    # Llama-3.2-1B: 32 KiB a token; 32 tensors of 8 MiB = 8,192 tokens; a rule of 1 KiB a token + 1
    # MiB = 9 MiB
    rec = recording(
        startup_snapshot(weights=(100 * MiB,), num_kv=32, kv_bytes=8 * MiB, linked=(9 * MiB,))
    )
    engine = EnginePreset("toy", "", kv_linked=(KvLinkedRule("mask", 1024, MiB),))
    inputs = plan_inputs(
        rec, device_bytes=1 << 30, model="Llama-3.2-1B", block_tokens=16, engine=engine
    )
    (buffer,) = inputs.linked
    assert [rec.sizes[k] for k in buffer.ops] == [9 * MiB] and buffer.bytes_per_page == 16 * 1024
    assert inputs.linked_bytes(int(inputs.recorded_pages) + 10) == 9 * MiB + 10 * 16 * 1024
    other = EnginePreset("toy", "", kv_linked=(KvLinkedRule("mask", 2048, MiB),))
    assert plan_inputs(rec, device_bytes=1 << 30, model="Llama-3.2-1B", engine=other).linked == ()
    with pytest.raises(PlanError, match="give --model"):
        plan_inputs(rec, device_bytes=1 << 30, engine=engine)


@pytest.mark.parametrize(
    "text, words",
    [
        ("entries=5", "expected SELECTOR:BYTES_PER_PAGE"),
        ("entries=5:lots", "'lots' is no size"),
        ("weights:4MiB", "--kv-linked 'weights': expected size=SIZE"),
    ],
)
def test_bad_linked_options_say_what_is_wrong(text, words):
    with pytest.raises(PlanError, match=words):
        parse_kv_linked(text)


def test_a_linked_selector_naming_nothing_or_the_kv_itself_is_refused():
    rec = recording(startup_snapshot(num_kv=2, kv_bytes=128 * MiB, linked=(20 * MiB,)))
    with pytest.raises(
        PlanError, match="--kv-linked 'size=3MiB:1MiB': no allocation of the trace matches"
    ):
        plan(rec, device_bytes=1 << 30, kv_linked=[parse_kv_linked("size=3MiB:1MiB")])
    with pytest.raises(PlanError, match="names a KV allocation"):
        plan(rec, device_bytes=1 << 30, kv_linked=[parse_kv_linked("size=128MiB:1MiB")])


def test_pages_of_a_model_give_tokens_and_split_over_the_kv_tensors():
    # Llama-3.2-1B: 16 layers x 8 KV heads x 64 x 2 B x 2 = 32 KiB a token: 32 tensors, 16 KiB each
    # a page
    rec = recording(
        startup_snapshot(weights=(100 * MiB,), num_kv=32, kv_bytes=8 * MiB, warmup=(50 * MiB,))
    )
    result = plan(rec, ["best-fit"], device_bytes=256 * MiB, model="Llama-3.2-1B")
    inputs, row = result.inputs, result.table().iloc[0]
    assert inputs.page_bytes == 16 * 32 * 1024 and inputs.share_bytes == 16 * 1024
    assert row.safe_kv_tokens == row.safe_kv_pages * 16 and row.model == "Llama-3.2-1B"
    assert row.safe_kv_pages == brute_force_safe_pages(
        inputs, "best-fit", inputs.capacity_bytes // inputs.page_bytes + 2
    )


def test_a_model_whose_page_does_not_split_over_the_kv_tensors_is_refused():
    rec = recording(startup_snapshot(num_kv=3))
    with pytest.raises(PlanError, match="does not split evenly over the 3 KV allocations"):
        plan_inputs(rec, device_bytes=1 << 30, model="Llama-3.2-1B")


def test_weights_that_do_not_fit_leave_no_kv_and_say_so():
    rec = recording(startup_snapshot(weights=(), pre_trace_weights=(600 * MiB,), num_kv=2))
    p = plan(
        rec, ["torch-caching"], device_bytes=512 * MiB, kv=[parse_kv_selector("size=128MiB")]
    ).plans[0]
    assert p.safe_pages == 0 and p.safe is None and p.next_page.at_start


def test_a_run_whose_warm_up_alone_does_not_fit_leaves_no_kv():
    rec = recording(startup_snapshot(weights=(100 * MiB,), warmup=(500 * MiB,)))
    p = plan(rec, ["best-fit"], device_bytes=512 * MiB).plans[0]
    assert p.safe_pages == 0 and rec.sizes[p.next_page.oom_op] == 500 * MiB


def test_the_engine_rule_misses_what_comes_after_the_profiling_run():
    # profiled peak 40 MiB, but the warm-up after the KV cache needs 250 MiB: the rule (0.9 x 1 GiB
    # - 140 MiB = 780 MiB of KV) runs out of memory there, where the plan leaves room for it
    rec = recording(
        startup_snapshot(weights=(100 * MiB,), profiling=(40 * MiB,), num_kv=2, warmup=(250 * MiB,))
    )
    result = plan(rec, ["torch-caching"], device_bytes=1024 * MiB, util_fraction=0.9)
    row = result.table().iloc[0]
    assert row.profiled_peak_bytes == 40 * MiB
    assert row.util_rule_kv_bytes == (int(0.9 * 1024 * MiB) - 140 * MiB) // (4 * MiB) * 4 * MiB
    assert not row.util_rule_fits and rec.sizes[int(row.util_rule_oom_event)] == 250 * MiB
    assert row.safe_kv_bytes == (1024 - 350) // 4 * 4 * MiB
    assert row.util_rule_excess_bytes > 0
    assert "after the KV cache" in result.describe_oom(int(row.util_rule_oom_event))


def test_non_torch_memory_comes_off_the_pool():
    rec = recording(startup_snapshot(weights=(100 * MiB,), num_kv=2, warmup=(50 * MiB,)))
    row = (
        plan(rec, ["torch-caching"], device_bytes=1024 * MiB, non_torch_bytes=200 * MiB)
        .table()
        .iloc[0]
    )
    assert row.capacity_bytes == 824 * MiB and row.safe_kv_pages == (824 - 150) // 4


# ------------------------------------------------------------------ the snapshots users have (H200)
def test_cuda_graphs_in_a_private_pool_brute_force():
    """The H200 recording of an engine's pattern: a static KV cache of 12 x 32 MiB, then one CUDA
    graph per batch size captured into one private pool, then eager prefills."""
    rec = read_recording(SNAPSHOTS / "graphs.pickle.gz")
    assert rec.pool_calls  # the capture windows are replayed into the private pool
    result = plan(rec, ["torch-caching"], device_bytes=2 << 30)
    inputs, p = result.inputs, result.plans[0]
    assert len(inputs.kv.ops) == 12 and inputs.kv.nbytes == 32 * MiB
    assert p.safe_pages == brute_force_safe_pages(inputs, "torch-caching", 60) == 46
    assert p.util is not None and not p.util.fits


def test_a_policy_that_cannot_hold_the_starting_state_is_refused():
    # segments recorded without expandable segments are no runs of 20 MiB pages
    rec = read_recording(SNAPSHOTS / "graphs.pickle.gz")
    with pytest.raises(
        PlanError,
        match="expandable cannot start from .*graphs.pickle.gz's state when recording began",
    ):
        plan(rec, ["expandable"], device_bytes=2 << 30)


def test_expandable_segments_plan_fits_and_one_page_more_does_not():
    # eager generation whose one never-freed 32 MiB tensor stands in for a cache (smaller than the
    # weights live before recording, so it is named)
    rec = read_recording(SNAPSHOTS / "expandable.pickle.gz")
    result = plan(
        rec,
        ["torch-caching:expandable_segments=True"],
        device_bytes=1 << 30,
        kv=[parse_kv_selector("size=32MiB")],
    )
    inputs, p = result.inputs, result.plans[0]
    assert p.safe_pages > inputs.recorded_pages  # the recorded 32 MiB cache fit with room to spare
    assert (
        fits(inputs, p.spec, p.safe_pages).fits and not fits(inputs, p.spec, p.safe_pages + 1).fits
    )


# ---------------------------------------------------------------------------- plan.csv
def test_plan_csv_round_trips_and_gives_each_policy_its_budget(tmp_path):
    rec = recording(startup_snapshot(weights=(100 * MiB,), num_kv=2, warmup=(50 * MiB,)))
    result = plan(rec, ["torch-caching", "best-fit"], device_bytes=1024 * MiB)
    path = write_plan(tmp_path / "plan", result)
    table = read_plan(tmp_path / "plan")
    assert list(table.columns) == PLAN_COLUMNS and list(table["policy"]) == [
        "torch-caching",
        "best-fit",
    ]
    assert read_plan(path).equals(table)
    budgets = planned_budgets(table, ["best-fit", "torch-caching"], source=str(path))
    assert budgets == dict(
        zip(result.table()["policy"], result.table()["safe_kv_bytes"].astype(int))
    )
    with pytest.raises(
        PlanError, match="no plan for policy 'paged' .*it has torch-caching, best-fit"
    ):
        planned_budgets(table, ["paged"], source=str(path))


def test_a_file_that_is_no_plan_names_the_file(tmp_path):
    bad = tmp_path / "plan.csv"
    bad.write_text("policy,peak\nbest-fit,3\n")
    with pytest.raises(TraceFormatError, match="no column 'safe_kv_bytes'"):
        read_plan(bad)
    bad.write_text("policy,safe_kv_bytes\nbest-fit,4096\npaged,lots\n")
    with pytest.raises(
        TraceFormatError, match=r"plan\.csv:3: safe_kv_bytes 'lots' of policy 'paged'"
    ):
        read_plan(bad)
    bad.write_text("policy,safe_kv_bytes\nbest-fit,0\npaged,4096\n")
    assert planned_budgets(read_plan(bad), ["paged"], source="p") == {
        "paged": 4096
    }  # the other row is not asked
    with pytest.raises(PlanError, match="p: the plan found no KV size with which best-fit serves"):
        planned_budgets(read_plan(bad), ["best-fit"], source="p")


def test_a_snapshot_file_plans_like_its_recording(tmp_path):
    from sim.planner.plan import plan_snapshot

    snap = startup_snapshot(weights=(100 * MiB,), num_kv=2, warmup=(50 * MiB,))
    from_file = plan_snapshot(
        write(tmp_path, snap), ["torch-caching"], device_bytes=1024 * MiB
    ).table()
    from_dict = plan(recording(snap), ["torch-caching"], device_bytes=1024 * MiB).table()
    assert (
        from_file["safe_kv_bytes"].tolist()
        == from_dict["safe_kv_bytes"].tolist()
        == [218 * 4 * MiB]
    )


def test_bench_plan_lengthens_a_recording_without_changing_its_answer(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_plan", Path(__file__).resolve().parents[3] / "benchmarks" / "bench_plan.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    snap = pickle.loads(gzip.decompress((SNAPSHOTS / "graphs.pickle.gz").read_bytes()))
    longer, copies = bench.lengthen(snap, 30_000)
    rec = snapshot_to_recording(parse_snapshot(longer))
    assert copies > 0 and len(rec.ops) >= 30_000
    assert (
        plan(rec, ["torch-caching"], device_bytes=2 << 30).plans[0].safe_pages == 46
    )  # as the recording's own
    assert bench.main(["--events", "20000", "--memory", "2GiB"]) == 0
    assert "torch-caching: plan" in capsys.readouterr().out


# ------------------------------------------------------------------ a real engine's start-up (H200)
STARTUP = SNAPSHOTS / "startup_transformers_cb.pickle.gz"
#: what the engine reported (``startup_transformers_cb.json``): 64 K/V tensors of (3,060 + 2
#: padding) blocks of 256 tokens, each block 256 x 8 KV heads x 128 x 2 B
STARTUP_KV_TENSOR_BYTES = 1_605_369_856
STARTUP_TOTAL_BYTES = 150_109_880_320  # torch.cuda.mem_get_info()'s total on that H200


@pytest.fixture(scope="module")
def startup_rec():
    return read_recording(STARTUP)


def test_a_real_engines_kv_cache_is_recognised_as_the_engine_reported_it(startup_rec):
    inputs = plan_inputs(
        startup_rec, device_bytes=STARTUP_TOTAL_BYTES, model="Llama-3-8B", block_tokens=256
    )
    assert len(inputs.kv.ops) == 64 and inputs.kv.nbytes == STARTUP_KV_TENSOR_BYTES
    assert inputs.page_bytes == 32 * MiB and inputs.share_bytes == 256 * 8 * 128 * 2
    assert inputs.recorded_pages == 3_062  # the engine's 3,060 blocks and its 2 padding blocks
    assert (
        inputs.weights_bytes == 16_060_523_008
    )  # 14.96 GiB of bf16 weights, allocated in the trace


def test_a_real_start_up_fits_its_own_kv_cache_in_the_memory_it_really_reserved(startup_rec):
    # the emulation reserves what PyTorch reserved at start-up (poollab fidelity): with exactly that
    # much memory the recorded cache still fits, and the plan is at least that large
    recorded_peak = int(startup_rec.recorded_reserved().max())
    result = plan(
        startup_rec, None, device_bytes=recorded_peak, model="Llama-3-8B", block_tokens=256
    )
    p = result.plans[0]
    assert p.spec == "torch-caching" and p.safe_pages >= 3_062
    assert p.safe.peak_reserved_bytes <= recorded_peak and not p.next_page.fits


def test_a_real_start_up_on_the_whole_h200(startup_rec):
    result = plan(
        startup_rec,
        ["torch-caching"],
        device_bytes=STARTUP_TOTAL_BYTES,
        model="Llama-3-8B",
        block_tokens=256,
    )
    inputs, p = result.inputs, result.plans[0]
    assert (
        fits(inputs, p.spec, p.safe_pages).fits and not fits(inputs, p.spec, p.safe_pages + 1).fits
    )
    assert p.safe_pages > 3_062  # the engine's 0.9-of-free rule left room unused at start-up
    row = result.table().iloc[0]
    assert row.safe_kv_tokens == p.safe_pages * 256
    assert row.peak_non_kv_reserved_bytes + row.safe_kv_bytes <= STARTUP_TOTAL_BYTES
    assert (
        p.next_page.oom_op > inputs.kv.ops[-1]
    )  # what fails first with one page more comes after the cache


#: transformers' paged|sdpa attention mask at that start-up: 8,192 x (3,060 x 256 + 8,192) bf16
STARTUP_MASK_BYTES = 12_968_787_968


def test_a_real_start_ups_attention_mask_is_recognised_and_grows_with_the_cache(startup_rec):
    result = plan(
        startup_rec,
        ["torch-caching"],
        device_bytes=STARTUP_TOTAL_BYTES,
        model="Llama-3-8B",
        block_tokens=256,
        engine="transformers",
    )
    inputs, p = result.inputs, result.plans[0]
    (mask,) = inputs.linked
    assert [startup_rec.sizes[k] for k in mask.ops] == [STARTUP_MASK_BYTES]
    assert mask.bytes_per_page == 4 * MiB  # 256 tokens x 8,192 x 2 B
    assert inputs.linked_bytes(3_062) == STARTUP_MASK_BYTES
    unlinked = plan(
        startup_rec,
        ["torch-caching"],
        device_bytes=STARTUP_TOTAL_BYTES,
        model="Llama-3-8B",
        block_tokens=256,
    ).plans[0]
    # the mask takes 4 MiB of each 36 MiB a page costs: the plan is smaller by about a ninth of the
    # growth
    assert 3_062 < p.safe_pages < unlinked.safe_pages
    assert not fits(inputs, p.spec, p.safe_pages + 1).fits
    assert (
        result.table().iloc[0].kv_linked_bytes
        == STARTUP_MASK_BYTES + (p.safe_pages - 3_062) * 4 * MiB
    )


# --------------------------------------------------------------------- the H200 check of session 12
#: A start-up recorded by `gpu serve --snapshot --snapshot-until both` with the JSON it wrote beside
#: it: the device memory the engine's process held outside PyTorch's allocator, 0.72 GiB at
#: start-up's end and at most while serving (benchmarks/results/engine_check/plan_check_s12)
MEASURED = SNAPSHOTS / "startup_transformers_cb_measured.pickle.gz"
#: what PyTorch reserved at its peak in the fresh engine processes that served 8 and 12 requests at
#: the planned --num-blocks 3,482 (summary.csv's peak_reserved_bytes of both H200 calls)
MEASURED_RUN_PEAK_RESERVED = 149_325_611_008


def test_a_plan_from_the_engines_own_figures_is_what_the_h200_served_and_one_page_more_is_what_failed():  # noqa: E501
    from sim.planner.plan import plan_snapshot

    result = plan_snapshot(
        MEASURED, ["torch-caching"], model="Llama-3-8B", block_tokens=256, engine="transformers"
    )
    inputs, p = result.inputs, result.plans[0]
    row = result.table().iloc[0]
    assert inputs.device_bytes == STARTUP_TOTAL_BYTES and row.non_torch_bytes == 772_603_904
    assert "measured in the engine's process" in row.non_torch_source
    assert (p.safe_pages, row.engine_num_blocks) == (3_484, 3_482)
    # the replay's peak at the planned size is the real run's, to the byte
    assert p.safe.peak_reserved_bytes == MEASURED_RUN_PEAK_RESERVED
    # one page more: the 224 MiB warm-up request on stream 1 that ran out of memory on the H200 at
    # 3,483 blocks
    k = p.next_page.oom_op
    assert inputs.rec.sizes[k] == 224 * MiB and inputs.rec.streams[k] == 1 and k > inputs.kv.ops[-1]
