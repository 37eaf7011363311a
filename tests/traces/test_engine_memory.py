"""The JSON beside a snapshot with the device memory the engine's process held outside PyTorch's
allocator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from traces.engine_memory import read_engine_memory, sidecar_path, write_engine_memory
from traces.errors import TraceFormatError

MiB = 1 << 20


@pytest.mark.parametrize(
    "name, expected",
    [
        ("startup.pickle.gz", "startup.json"),
        ("a.b.pkl", "a.b.json"),
        ("s.pickle", "s.json"),
        ("s.gz", "s.json"),
        ("raw", "raw.json"),
    ],
)
def test_the_json_is_named_after_the_snapshot(name, expected):
    assert sidecar_path(Path("/d") / name) == Path("/d") / expected


def test_what_gpu_serve_writes_reads_back_and_the_larger_figure_is_the_plans(tmp_path):
    snapshot = tmp_path / "snapshot_pytorch.pickle.gz"
    assert read_engine_memory(snapshot) is None  # no file: nothing measured
    path = write_engine_memory(
        snapshot,
        {
            "mem_get_info_total_bytes": 150_109_880_320,
            "non_torch_startup_bytes": 700 * MiB,
            "non_torch_serving_max_bytes": 744 * MiB,
            "kv_padding_blocks": 2,
            "gpu": "NVIDIA H200",
        },
    )
    assert (
        path == tmp_path / "snapshot_pytorch.json"
        and json.loads(path.read_text())["non_torch_bytes"] == 744 * MiB
    )
    found = read_engine_memory(snapshot)
    assert (
        found.total_bytes,
        found.non_torch_bytes,
        found.non_torch_startup_bytes,
        found.padding_blocks,
    ) == (150_109_880_320, 744 * MiB, 700 * MiB, 2)
    assert found.describe_non_torch() == (
        "measured in the engine's process "
        "(700.0 MiB at start-up's end, 744.0 MiB at most while serving), snapshot_pytorch.json"
    )


def test_a_file_with_the_parts_only_takes_the_larger(tmp_path):
    snapshot = tmp_path / "s.pickle.gz"
    (tmp_path / "s.json").write_text(
        json.dumps({"non_torch_startup_bytes": 5, "non_torch_serving_max_bytes": 3})
    )
    assert read_engine_memory(snapshot).non_torch_bytes == 5
    (tmp_path / "s.json").write_text(
        json.dumps({"scenario": "x"})
    )  # the older fixtures' files: no figure
    found = read_engine_memory(snapshot)
    assert found is not None and found.non_torch_bytes is None and found.total_bytes is None


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"non_torch_bytes": 5,\n "mem_get_info_total_bytes": }', ["s.json:2", "not JSON"]),
        ("[1, 2]", ["s.json:1", "not a JSON object but list"]),
        ('{"non_torch_bytes": -1}', ["non_torch_bytes -1", "no whole number of bytes"]),
        ('{"non_torch_bytes": 1.5}', ["non_torch_bytes 1.5"]),
        ('{"kv_padding_blocks": true}', ["kv_padding_blocks True"]),
        (
            '{"non_torch_bytes": 10, "mem_get_info_total_bytes": 10}',
            ["is not below the device's memory"],
        ),
        (
            '{"non_torch_bytes": 5, "non_torch_startup_bytes": 5, "non_torch_serving_max_bytes": '
            "1180591620717411303424}",
            ["non_torch_bytes 5 is not the larger of", "(1,180,591,620,717,411,303,424)"],
        ),
        (
            '{"non_torch_startup_bytes": 1180591620717411303424, "mem_get_info_total_bytes": 10}',
            ["is not below the device's memory"],
        ),
    ],
)
def test_a_bad_file_names_itself_and_what_is_wrong(tmp_path, text, words):
    (tmp_path / "s.json").write_text(text)
    with pytest.raises(TraceFormatError) as err:
        read_engine_memory(tmp_path / "s.pickle.gz")
    assert all(w in str(err.value) for w in words), str(err.value)
