import numpy as np
import pytest

from policies.device import VirtualDevice
from realgpu.host import HostDevice

MiB = 1 << 20


def test_offsets_are_the_virtual_devices():
    host, virtual = HostDevice(), VirtualDevice()
    sizes = [3 * MiB, 512, 40 * MiB, 2 * MiB]
    assert [host.reserve(n) for n in sizes] == [virtual.reserve(n) for n in sizes]


def test_address_maps_offsets_into_the_segments_memory():
    dev = HostDevice()
    a, b = dev.reserve(4 * MiB), dev.reserve(4 * MiB)
    assert dev.address(b + 100) == dev.view(b, 1).ctypes.data + 100
    assert dev.address(a + 4 * MiB - 1) - dev.address(a) == 4 * MiB - 1


def test_the_address_tables_stay_aligned_as_segments_come_and_go():
    """``address_tables()``: the sorted segment offsets and their bases in the same order (what
    ``GpuPool.malloc`` reads by index), kept so through reserves and releases in any order."""
    import random

    rng = random.Random(4)
    dev = HostDevice()
    starts, bases = dev.address_tables()
    live = {}
    for _ in range(60):
        if live and rng.random() < 0.45:
            offset = rng.choice(sorted(live))
            dev.release(offset, live.pop(offset))
        else:
            nbytes = rng.choice([2, 4, 6]) * MiB
            live[dev.reserve(nbytes)] = nbytes
        assert dev.address_tables() == (starts, bases)  # the same live lists, mutated in place
        assert starts == sorted(live) and len(bases) == len(starts)
        for offset in live:
            assert (
                bases[starts.index(offset)]
                == dev.view(offset, 1).ctypes.data
                == dev.address(offset)
            )


def test_limit_makes_reserve_refuse_without_taking_an_offset():
    dev = HostDevice(limit_bytes=5 * MiB)
    first = dev.reserve(4 * MiB)
    assert dev.reserve(2 * MiB) is None
    assert dev.num_refused == 1
    dev.release(first, 4 * MiB)
    assert dev.reserve(2 * MiB) == VirtualDevice().reserve(4 * MiB) + 4 * MiB + 2 * MiB


def test_release_gives_memory_back_and_counts():
    dev = HostDevice()
    off = dev.reserve(MiB)
    dev.release(off, MiB)
    assert (
        dev.used_bytes,
        dev.peak_used_bytes,
        dev.num_maps,
        dev.num_unmaps,
        dev.num_segments,
    ) == (0, MiB, 1, 1, 0)


def test_release_of_a_wrong_size_is_an_invariant_failure():
    dev = HostDevice()
    off = dev.reserve(MiB)
    with pytest.raises(AssertionError):
        dev.release(off, 2 * MiB)


def test_locate_outside_every_segment_fails():
    dev = HostDevice()
    off = dev.reserve(MiB)
    with pytest.raises(AssertionError):
        dev.locate(off + MiB)


@pytest.mark.parametrize("phase", [0, 1, 2, 3])
def test_fill_then_check_finds_nothing(phase):
    dev = HostDevice()
    off = dev.reserve(MiB)
    dev.fill(off + 3, 1001, 0x80C0FFEE, phase)
    assert dev.first_mismatch(off + 3, 1001, 0x80C0FFEE, phase) == -1


def test_fill_writes_the_word_little_endian_from_the_phase():
    dev = HostDevice()
    off = dev.reserve(MiB)
    dev.fill(off, 6, 0x44332211, 1)
    assert dev.read_bytes(off, 6) == bytes([0x22, 0x33, 0x44, 0x11, 0x22, 0x33])


def test_check_reports_the_first_changed_byte():
    dev = HostDevice()
    off = dev.reserve(MiB)
    dev.fill(off, 4096, 0x80000001, 0)
    dev.view(off, 4096)[[777, 3000]] = 0xEE
    assert dev.first_mismatch(off, 4096, 0x80000001, 0) == 777


def test_touch_writes_first_and_last_bytes_only():
    dev = HostDevice()
    off = dev.reserve(MiB)
    dev.touch(off, 1000)
    view = dev.view(off, 1000)
    assert (view[:64] == 0x5A).all() and (view[-64:] == 0x5A).all()
    assert not (view[64:-64] == 0x5A).any()


@pytest.mark.parametrize("phase", [0, 1, 2, 3])
def test_fill_and_check_span_many_pieces_at_every_phase(phase):
    from realgpu.host import _PIECE_BYTES

    dev = HostDevice()
    off = dev.reserve(4 * MiB)
    nbytes = 3 * _PIECE_BYTES + 5  # past several pieces, ending part way into a word
    dev.fill(off + 1, nbytes, 0x80C0FFEE, phase)
    got = np.frombuffer(dev.read_bytes(off + 1, nbytes), dtype=np.uint8)
    word = (0x80C0FFEE).to_bytes(4, "little")
    expected = np.frombuffer((word[phase:] + word[:phase]) * (nbytes // 4 + 1), dtype=np.uint8)[
        :nbytes
    ]
    assert np.array_equal(got, expected)
    assert (
        dev.read_bytes(off, 1) == b"\0" and dev.read_bytes(off + 1 + nbytes, 1) == b"\0"
    )  # nothing outside
    for bad in (0, _PIECE_BYTES - 1, _PIECE_BYTES, 2 * _PIECE_BYTES + 17, nbytes - 1):
        dev.view(off + 1 + bad, 1)[:] ^= 0x01
        assert dev.first_mismatch(off + 1, nbytes, 0x80C0FFEE, phase) == bad
        dev.view(off + 1 + bad, 1)[:] ^= 0x01
    assert dev.first_mismatch(off + 1, nbytes, 0x80C0FFEE, phase) == -1


def test_the_check_without_libc_finds_the_same_byte(monkeypatch):
    import realgpu.host as host

    monkeypatch.setattr(host, "_memcmp", None)  # no C library by name: numpy compares
    dev = HostDevice()
    off = dev.reserve(MiB)
    nbytes = 2 * host._PIECE_BYTES + 9
    dev.fill(off, nbytes, 0x80000077, 2)
    assert dev.first_mismatch(off, nbytes, 0x80000077, 2) == -1
    dev.view(off + host._PIECE_BYTES + 3, 1)[:] ^= 0x04
    assert dev.first_mismatch(off, nbytes, 0x80000077, 2) == host._PIECE_BYTES + 3
