"""Fidelity: a PyTorch snapshot replayed through torch-caching from its real starting state."""

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import policies
from policies.torch_caching import spec_from_settings
from sim.replay.fidelity import (
    ALLOC,
    EMPTY_CACHE,
    FREE,
    RecordedAddressDevice,
    fidelity,
    read_recording,
    replay_recording,
    snapshot_to_recording,
)
from traces import bundled_path
from traces.pytorch_snapshot import parse_snapshot

MiB = 1 << 20
SNAPSHOT = Path("/work/shared/data/traces/llama1b_generate_mixed.pickle.gz")
BASE, OTHER = 0x7F00_0000_0000, 0x7E00_0000_0000


def entry(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 0}


def snapshot(entries, segments=(), settings=None):
    """A parsed snapshot of one device."""
    return parse_snapshot(
        {
            "device_traces": [list(entries)],
            "segments": list(segments),
            "allocator_settings": settings or {},
        }
    )


def segment(addr, total, blocks, kind="large"):
    return {
        "device": 0,
        "address": addr,
        "total_size": total,
        "stream": 0,
        "segment_type": kind,
        "blocks": [
            {"address": a, "size": n, "requested_size": r, "state": s} for a, n, r, s in blocks
        ],
    }


def metric(result, name):
    return result.summary()[name]


# ----------------------------------------------------------------- the real recordings
def test_the_bundled_slice_is_reproduced_exactly():
    result = fidelity(bundled_path("llama1b_generate_slice.pickle.gz"))
    assert metric(result, "segment allocations") == (16, 16)
    assert metric(result, "peak reserved bytes") == (2_176_843_776, 2_176_843_776)
    assert metric(result, "allocations at the recorded address %") == (100.0, 100.0)
    assert result.first_divergence is None


@pytest.mark.skipif(not SNAPSHOT.exists(), reason="the full snapshot is not on this machine")
def test_the_full_snapshot_is_within_one_percent_of_the_recording():
    result = fidelity(SNAPSHOT)
    table = result.table.set_index("metric")
    assert (
        table.loc["segment allocations", "within_1pct"]
        and table.loc["peak reserved bytes", "within_1pct"]
    )
    assert metric(result, "peak reserved bytes")[0] == 2_214_592_512


def test_virtual_addresses_break_best_fit_ties_differently():
    rec = read_recording(bundled_path("llama1b_generate_slice.pickle.gz"))
    virtual = replay_recording(rec, addresses="virtual")
    assert virtual.first_divergence is not None
    assert metric(virtual, "segment allocations")[1] != 16


def test_the_starting_state_holds_the_weights_at_their_addresses():
    rec = read_recording(bundled_path("llama1b_generate_slice.pickle.gz"))
    assert len(rec.seed_segments) == 67 and rec.initial_reserved_bytes == 1630 * MiB
    assert sum(len(s.blocks) for s in rec.seed_segments) == 149 and not rec.unplaced


# ----------------------------------------------------------------- the starting state
def test_blocks_freed_by_the_trace_get_pytorchs_size_with_an_unsplit_remainder():
    seg = segment(BASE, 20 * MiB, [(BASE, 20 * MiB, 0, "inactive")])
    rec = snapshot_to_recording(
        snapshot(
            [
                entry("free_completed", BASE, 4 * MiB - 100),  # never allocated in the trace
                entry(
                    "free_completed", BASE + 4 * MiB, 15 * MiB + 1
                ),  # 16 MiB - 512 B left after rounding: kept
                entry("alloc", BASE, 10 * MiB),
            ],
            [seg],
        )
    )
    (seed,) = rec.seed_segments
    assert seed.blocks == [(0, 4 * MiB, 4 * MiB - 100), (4 * MiB, 16 * MiB, 15 * MiB + 1)]
    result = replay_recording(rec)
    assert metric(result, "segment allocations") == (0, 0) and result.first_divergence is None


def test_a_new_segment_is_compared_with_the_recorded_one():
    seg = segment(OTHER, 30 * MiB, [(OTHER, 30 * MiB, 30 * MiB, "active_allocated")])
    rec = snapshot_to_recording(
        snapshot([entry("segment_alloc", OTHER, 30 * MiB), entry("alloc", OTHER, 30 * MiB)], [seg])
    )
    assert rec.seed_segments == []
    result = replay_recording(rec)
    assert metric(result, "segment allocation bytes") == (30 * MiB, 30 * MiB)
    assert metric(result, "allocations at the recorded address %") == (100.0, 100.0)


def test_frees_no_reservation_follows_are_an_empty_cache_call():
    rec = snapshot_to_recording(
        snapshot(
            [
                entry("segment_alloc", BASE, 20 * MiB),
                entry("alloc", BASE, 3 * MiB),
                entry("segment_alloc", OTHER, 2 * MiB),
                entry("alloc", OTHER, 100),
                entry("free_completed", BASE, 3 * MiB),
                entry("segment_free", BASE, 20 * MiB),
                entry("free_completed", OTHER, 100),
            ]
        )
    )
    assert rec.ops.count(EMPTY_CACHE) == 1 and rec.ops.index(EMPTY_CACHE) == 3
    result = replay_recording(rec)
    assert metric(result, "segment frees") == (1, 1) and result.first_divergence is None


def test_frees_before_a_reservation_are_an_empty_cache_call_replayed_as_such():
    # torch.cuda.graph calls empty_cache() right before capture: frees, then a reservation
    rec = snapshot_to_recording(
        snapshot(
            [
                entry("segment_alloc", BASE, 30 * MiB),
                entry("alloc", BASE, 30 * MiB),
                entry("free_completed", BASE, 30 * MiB),
                entry("segment_free", BASE, 30 * MiB),
                entry("segment_alloc", OTHER, 36 * MiB),
                entry("alloc", OTHER, 35 * MiB),
            ]
        )
    )
    assert rec.ops == [ALLOC, FREE, EMPTY_CACHE, ALLOC]
    for capacity in (None, 40 * MiB):  # without a limit there is no retry to free them
        result = replay_recording(rec, capacity_bytes=capacity)
        assert metric(result, "segment frees") == (1, 1) and result.first_divergence is None
        assert metric(result, "peak reserved bytes") == (36 * MiB, 36 * MiB)


def test_oversize_frees_before_a_reservation_stay_the_retry_with_max_split_size():
    rec = snapshot_to_recording(
        snapshot(
            [
                entry("segment_alloc", BASE, 30 * MiB),
                entry("alloc", BASE, 30 * MiB),
                entry("free_completed", BASE, 30 * MiB),
                entry("segment_free", BASE, 30 * MiB),
                entry("segment_alloc", OTHER, 36 * MiB),
                entry("alloc", OTHER, 35 * MiB),
            ],
            settings={"max_split_size": 25 * MiB},
        )
    )
    assert EMPTY_CACHE not in rec.ops
    result = replay_recording(rec, capacity_bytes=40 * MiB)
    assert metric(result, "segment frees") == (1, 1) and result.first_divergence is None


def test_a_divergence_names_the_first_differing_decision():
    rec = snapshot_to_recording(
        snapshot([entry("segment_alloc", BASE, 20 * MiB), entry("alloc", BASE, 3 * MiB)])
    )
    result = replay_recording(rec, "best-fit")  # reserves 32 MiB segments
    assert result.first_divergence["index"] == 0
    assert (
        "20.0 MiB" in result.first_divergence["recorded"]
        and "32.0 MiB" in result.first_divergence["emulated"]
    )


# ----------------------------------------------------------------- settings and devices
def test_settings_become_a_torch_caching_spec():
    assert (
        spec_from_settings({"max_split_size": -1, "roundup_power2_divisions": {"1": 0, "2": 0}})
        == "torch-caching"
    )
    spec = spec_from_settings(
        {
            "max_split_size": 64 * MiB,
            "garbage_collection_threshold": 0.6,
            "roundup_power2_divisions": {str(1 << k): 4 for k in range(16)},
        }
    )
    p = policies.create(spec)
    assert (p.max_split_size_bytes, p.roundup_power2_divisions, p.garbage_collection_threshold) == (
        64 * MiB,
        4,
        0.6,
    )


def test_per_interval_divisions_survive_the_spec_string():
    divisions = {str(1 << k): (8 if k >= 8 else 2) for k in range(16)}
    p = policies.create(spec_from_settings({"roundup_power2_divisions": divisions}))
    assert p.round_size(300 * MiB + 1) == 320 * MiB  # 8 divisions of [256, 512) MiB
    assert policies.create(p.spec).get_params() == p.get_params()


def test_an_expandable_snapshot_is_compared_on_segment_map_events():
    # 4 MiB live at the start of a range with 20 MiB mapped; a 30 MiB request maps 20 MiB more
    seg = {
        "device": 0,
        "address": BASE,
        "total_size": 40 * MiB,
        "stream": 0,
        "segment_type": "large",
        "is_expandable": True,
        "segment_pool_id": (0, 0),
        "blocks": [
            {
                "address": BASE,
                "size": 4 * MiB,
                "requested_size": 4 * MiB,
                "state": "active_allocated",
            },
            {
                "address": BASE + 4 * MiB,
                "size": 30 * MiB,
                "requested_size": 30 * MiB,
                "state": "active_allocated",
            },
        ],
    }
    rec = snapshot_to_recording(
        snapshot(
            [
                entry("segment_map", BASE + 20 * MiB, 20 * MiB),
                entry("alloc", BASE + 4 * MiB, 30 * MiB),
            ],
            [seg],
            settings={"expandable_segments": True},
        )
    )
    assert [(s.nbytes, s.range_offset) for s in rec.seed_segments] == [(20 * MiB, 0)]
    result = replay_recording(rec)
    assert (
        result.spec == "torch-caching:expandable_segments=True" and result.first_divergence is None
    )
    assert metric(result, "peak reserved bytes") == (40 * MiB, 40 * MiB)


def test_the_recorded_address_device_hands_out_recorded_addresses_in_order():
    dev = RecordedAddressDevice([(BASE, 20 * MiB), (OTHER, 2 * MiB), (BASE + 40 * MiB, 20 * MiB)])
    assert [dev.reserve(20 * MiB), dev.reserve(2 * MiB), dev.reserve(20 * MiB)] == [
        BASE,
        OTHER,
        BASE + 40 * MiB,
    ]
    fresh = dev.reserve(20 * MiB)
    assert fresh >= BASE + 60 * MiB
    dev.pin(BASE + 100 * MiB)
    assert dev.reserve(4 * MiB) == BASE + 100 * MiB


def test_a_recorded_address_still_held_is_not_handed_out_twice():
    dev = RecordedAddressDevice([(BASE, 20 * MiB), (BASE + 10 * MiB, 4 * MiB)])
    assert dev.reserve(20 * MiB) == BASE
    assert dev.reserve(4 * MiB) != BASE + 10 * MiB  # it lies inside the held segment


# ----------------------------------------------------------------- the command
def _cli():
    from poollab.commands import fidelity as command

    group = click.Group()
    command.register(group)
    return group


def test_the_command_prints_the_comparison(tmp_path):
    out = CliRunner().invoke(
        _cli(),
        ["fidelity", str(bundled_path("llama1b_generate_slice.pickle.gz")), "--out", str(tmp_path)],
    )
    assert out.exit_code == 0, out.output
    assert "identical to the recording" in out.output and "peak reserved bytes" in out.output
    assert (tmp_path / "fidelity.csv").exists() and (tmp_path / "segment_events.csv").exists()


def test_the_command_compares_several_policies_and_address_modes():
    out = CliRunner().invoke(
        _cli(),
        [
            "fidelity",
            str(bundled_path("llama1b_generate_slice.pickle.gz")),
            "-p",
            "torch-caching",
            "-p",
            "best-fit",
            "--addresses",
            "both",
        ],
    )
    assert out.exit_code == 0, out.output
    assert (
        out.output.count("(addresses: recorded)") == 2
        and out.output.count("(addresses: virtual)") == 2
    )


def test_a_bracketed_conf_value_is_one_setting_not_several():
    from sim.replay.fidelity import unmodelled_conf_keys

    # the list inside the brackets once read as settings "512" and ">", unmodelled
    assert (
        unmodelled_conf_keys("roundup_power2_divisions:[256:1,512:2,>:8],expandable_segments:True")
        == []
    )
    assert unmodelled_conf_keys("pinned_use_cuda_host_register:True,max_split_size_mb:64") == [
        "pinned_use_cuda_host_register"
    ]
