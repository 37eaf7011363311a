import json

import pytest

from sim.replay.hardware import GpuSpec, available_gpus, load_gpu
from sim.replay.models import DATA_DIR

REQUIRED = ["H200", "H100", "A100-80GB", "A100-40GB", "L40S"]


def _fields(**overrides):
    fields = load_gpu("H100").to_dict()
    fields.update(overrides)
    return fields


def test_required_presets_are_available():
    assert set(REQUIRED) <= set(available_gpus())


def test_h200_memory_is_the_measured_total():
    assert load_gpu("H200").memory_bytes == 150_754_820_096  # pynvml total (field notes)


@pytest.mark.parametrize(
    "name, hbm, bf16",
    [
        ("H200", 4.8e12, 989.4e12),
        ("H100", 3.35e12, 989.4e12),
        ("A100-80GB", 2.039e12, 312e12),
        ("A100-40GB", 1.555e12, 312e12),
        ("L40S", 864e9, 362.05e12),
    ],
)
def test_datasheet_rates(name, hbm, bf16):
    gpu = load_gpu(name)
    assert gpu.hbm_bandwidth_bytes_per_s == hbm
    assert gpu.bf16_flops_per_s == bf16


@pytest.mark.parametrize("name", available_gpus())
def test_pcie_rate_is_below_the_link_peak_per_direction(name):
    assert 0 < load_gpu(name).pcie_bandwidth_bytes_per_s <= 64e9


def test_every_preset_cites_a_source():
    raw = json.loads((DATA_DIR / "gpus.json").read_text())
    assert all(entry.get("source", "").startswith("https://") for entry in raw["gpus"].values())


@pytest.mark.parametrize(
    "spelling, name",
    [
        ("h200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("a100-sxm4-80gb", "A100-80GB"),
        ("l40s", "L40S"),
    ],
)
def test_names_and_nvidia_smi_names(spelling, name):
    assert load_gpu(spelling).name == name


def test_fp32_rate_defaults_to_half_of_bf16():
    gpu = GpuSpec(**_fields(fp32_flops_per_s=None))
    assert gpu.flops_per_s("fp32") == gpu.flops_per_s("bf16") / 2


def test_h200_ridge_point_is_about_206_flops_per_byte():
    assert 200 < load_gpu("H200").ridge_flops_per_byte < 210


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown GPU 'b300'.*H200.*L40S"):
        load_gpu("b300")


def test_custom_gpu_from_json_file(tmp_path):
    path = tmp_path / "my-gpu.json"
    path.write_text(
        json.dumps(
            {
                "memory_bytes": 24 << 30,
                "hbm_bandwidth_bytes_per_s": 1e12,
                "bf16_flops_per_s": 200e12,
                "pcie_bandwidth_bytes_per_s": 25e9,
            }
        )
    )
    gpu = load_gpu(str(path))
    assert gpu.name == "my-gpu" and gpu.memory_bytes == 24 << 30
    assert gpu.fp32_flops_per_s is None


def test_custom_gpu_round_trips_through_to_dict(tmp_path):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(load_gpu("H200").to_dict()))
    assert load_gpu(path) == load_gpu("H200")


def test_bad_field_names_file_and_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(_fields(hbm_bandwidth_bytes_per_s=-1)))
    with pytest.raises(ValueError, match=r"bad\.json.*'hbm_bandwidth_bytes_per_s'"):
        load_gpu(path)


def test_non_integral_memory_names_the_field(tmp_path):
    path = tmp_path / "frac.json"
    path.write_text(json.dumps(_fields(memory_bytes=80.5)))
    with pytest.raises(ValueError, match=r"frac\.json.*'memory_bytes'.*whole number"):
        load_gpu(path)


def test_string_rate_names_the_field(tmp_path):
    path = tmp_path / "str.json"
    path.write_text(json.dumps(_fields(bf16_flops_per_s="989T")))
    with pytest.raises(ValueError, match=r"str\.json.*'bf16_flops_per_s'"):
        load_gpu(path)


def test_yaml_is_refused_with_a_hint(tmp_path):
    path = tmp_path / "gpu.yaml"
    path.write_text("name: x\n")
    with pytest.raises(ValueError, match=r"gpu\.yaml.*JSON"):
        load_gpu(path)
