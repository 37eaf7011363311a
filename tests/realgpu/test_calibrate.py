import json

import pytest

from realgpu.calibrate import DEFAULT_SIZES, repeats_for, write_costs
from sim.replay.costs import CostModel

MiB = 1 << 20


def test_sizes_run_from_4_kib_to_4_gib():
    assert DEFAULT_SIZES[0] == 4096 and DEFAULT_SIZES[-1] == 4 << 30


def test_fewer_calls_are_timed_where_calls_are_slow():
    counts = [repeats_for(n) for n in DEFAULT_SIZES]
    assert counts == sorted(counts, reverse=True) and counts[-1] >= 5


def test_written_table_is_read_back_by_the_simulator(tmp_path):
    table = {
        "device": "test",
        "malloc_us": {"nbytes": [4096, MiB], "us": [2.0, 40.0]},
        "free_us": {"nbytes": [4096, MiB], "us": [3.0, 30.0]},
        "d2d_bytes_per_s": 2e12,
        "h2d_bytes_per_s": 5e10,
        "d2h_bytes_per_s": 5e10,
    }
    path = write_costs(table, tmp_path / "c" / "costs.json")
    assert CostModel.load(path).malloc_ns(MiB) == 40_000
    assert json.loads(path.read_text())["device"] == "test"


def test_a_table_the_simulator_cannot_read_is_refused(tmp_path):
    with pytest.raises(ValueError, match="d2d_bytes_per_s"):
        write_costs(
            {"malloc_us": {"nbytes": [1], "us": [1]}, "free_us": {"nbytes": [1], "us": [1]}},
            tmp_path / "bad.json",
        )


@pytest.mark.gpu
def test_calibration_on_the_device_writes_a_usable_cost_file(tmp_path):
    from realgpu.calibrate import calibrate

    table = calibrate(
        sizes=(4096, MiB, 64 * MiB),
        repeats=5,
        copy_bytes=64 * MiB,
        host_copy_bytes=16 * MiB,
        copy_repeats=3,
    )
    model = CostModel.load(write_costs(table, tmp_path / "costs.json"))
    assert table["malloc_us"]["nbytes"] == [4096, MiB, 64 * MiB]
    assert all(us > 0 for us in table["malloc_us"]["us"] + table["free_us"]["us"])
    assert model.d2d_bytes_per_s > model.h2d_bytes_per_s > 0
