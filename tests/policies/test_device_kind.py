"""One device-kind vocabulary: ``policies.device_kind.DeviceKind``, read by policies, devices,
backends and options."""

import pytest

import policies
from policies.base import Policy
from policies.device import VirtualDevice
from policies.device_kind import PLATFORMS, DeviceKind
from policies.first_fit import FirstFit
from policies.mapped_device import PageMappedDevice
from sim.replay.costs import CostedDevice, costed_device


@pytest.mark.parametrize(
    "text,kind",
    [
        ("segment", DeviceKind.SEGMENT),
        ("page-mapped", DeviceKind.PAGE_MAPPED),
        ("segments", DeviceKind.SEGMENT),
        ("vmm", DeviceKind.PAGE_MAPPED),
        (" VMM ", DeviceKind.PAGE_MAPPED),
        (DeviceKind.SEGMENT, DeviceKind.SEGMENT),
    ],
)
def test_parse_reads_the_values_and_the_old_spellings_once(text, kind):
    assert DeviceKind.parse(text) is kind


@pytest.mark.parametrize("bad", ["paged", "", "cuda-vmm", None, 3])
def test_parse_refuses_anything_else_naming_where_and_the_kinds(bad):
    with pytest.raises(
        ValueError,
        match=r"^--device-kind: unknown device kind .*; one of segment, page-mapped, "
        r"segments, vmm$",
    ):
        DeviceKind.parse(bad, where="--device-kind")


def test_values_are_plain_strings_in_text_and_comparisons():
    assert f"{DeviceKind.PAGE_MAPPED}" == "page-mapped" == DeviceKind.PAGE_MAPPED
    assert [k.value for k in DeviceKind] == ["segment", "page-mapped"]


def test_backend_names_are_a_platform_and_a_kind():
    assert [DeviceKind.SEGMENT.backend(p) for p in PLATFORMS] == ["cuda", "host"]
    assert [DeviceKind.PAGE_MAPPED.backend(p) for p in PLATFORMS] == ["cuda-vmm", "host-vmm"]
    for backend in ("cuda", "host", "cuda-vmm", "host-vmm"):
        kind = DeviceKind.of_backend(backend)
        assert kind.backend(DeviceKind.platform_of(backend)) == backend
    with pytest.raises(ValueError, match="platform"):
        DeviceKind.SEGMENT.backend("rocm")


def test_policies_and_devices_declare_members_of_the_enum():
    for name in policies.available():
        assert isinstance(policies.registry.device_kind(name), DeviceKind), name
    assert policies.registry.device_kind("best-fit:virtual=true") is DeviceKind.PAGE_MAPPED
    assert (
        policies.registry.device_kind(policies.create("best-fit:virtual=true"))
        is DeviceKind.PAGE_MAPPED
    )  # an object: by its knobs
    assert (
        policies.registry.device_kind(policies.create("torch-caching:expandable_segments=true"))
        is DeviceKind.PAGE_MAPPED
    )
    assert VirtualDevice().device_kind is CostedDevice().device_kind is DeviceKind.SEGMENT
    assert PageMappedDevice().device_kind is DeviceKind.PAGE_MAPPED
    assert (
        policies.create("page-pool").device.device_kind is DeviceKind.PAGE_MAPPED
    )  # its range, in front of a mapped device
    assert isinstance(costed_device("vmm"), PageMappedDevice) and isinstance(
        costed_device("segment"), CostedDevice
    )


class OldStylePagePolicy(FirstFit):
    """A third-party policy written against the old string vocabulary."""

    name = "old-style"
    device_kind = "page-mapped"


class WrongKindPolicy(FirstFit):
    name = "wrong-kind"
    device_kind = "gpu"


def test_a_third_party_policy_declaring_a_plain_string_still_reads_as_the_kind():
    assert policies.registry.device_kind(OldStylePagePolicy) is DeviceKind.PAGE_MAPPED


def test_a_third_party_policy_declaring_no_kind_is_one_error_naming_it():
    with pytest.raises(
        policies.PolicyError, match=r"policy 'wrong-kind': device_kind: unknown device kind 'gpu'"
    ):
        policies.registry.device_kind(WrongKindPolicy)


def test_the_base_declares_segments():
    assert Policy.device_kind is DeviceKind.SEGMENT
