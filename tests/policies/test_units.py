import pytest
from hypothesis import given, strategies as st

from policies.errors import PolicyError
from policies.units import format_bytes, parse_bytes


@pytest.mark.parametrize(
    "text, nbytes",
    [
        ("512", 512),
        ("0", 0),
        ("1_048_576", 1 << 20),
        (4096, 4096),
        ("80GiB", 80 << 30),
        ("2MiB", 2 << 20),
        ("4KiB", 4096),
        ("1TiB", 1 << 40),
        ("1.5GB", 1_500_000_000),
        ("2k", 2000),
        ("3m", 3_000_000),
        ("1tb", 10**12),
        ("7b", 7),
        ("  4 KiB ", 4096),
        ("4kib", 4096),
        ("4KIB", 4096),
        ("0.5KiB", 512),
    ],
)
def test_parse_bytes_reads_sizes_people_write(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize(
    "text", ["", "abc", "KiB", "-1", "1.5.2MiB", "4 XB", "4 KiB B", "0x10", "1e3"]
)
def test_parse_bytes_refuses_what_is_no_size_and_names_it(text):
    with pytest.raises(PolicyError, match=f"cannot read {text!r} as a size in bytes"):
        parse_bytes(text)


def test_parse_bytes_refuses_fractions_of_a_byte():
    with pytest.raises(PolicyError, match="'1.5' is not a whole number of bytes"):
        parse_bytes("1.5")


def test_parse_bytes_refuses_negative_ints():
    with pytest.raises(PolicyError, match="-1 must not be negative"):
        parse_bytes(-1)


def test_parse_bytes_does_not_read_a_bool_as_a_number():
    with pytest.raises(PolicyError):
        parse_bytes(True)


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (2 << 20, "2.0 MiB"),
        (80 << 30, "80.0 GiB"),
        (3 << 40, "3.0 TiB"),
        (5000 << 40, "5000.0 TiB"),
        (-2048, "-2.0 KiB"),
    ],
)
def test_format_bytes_uses_binary_units(nbytes, text):
    assert format_bytes(nbytes) == text


@given(
    st.integers(0, 1 << 50),
    st.sampled_from([("B", 1), ("KiB", 1 << 10), ("MiB", 1 << 20), ("GiB", 1 << 30)]),
)
def test_integer_times_unit_round_trips(count, unit):
    name, scale = unit
    assert parse_bytes(f"{count}{name}") == count * scale


def test_parse_bytes_refuses_a_size_of_hundreds_of_digits_naming_it():
    """400 digits used to overflow to float infinity and raise OverflowError."""
    with pytest.raises(PolicyError, match="400 digits\\) is too large"):
        parse_bytes("9" * 400)


def test_parse_bytes_keeps_long_whole_numbers_exact():
    assert parse_bytes("18446744073709551617") == 2**64 + 1  # a float would have rounded it
