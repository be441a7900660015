"""Quantities (`shardc.dsl.quantities`): the one reader of bytes, rates and seconds the
language, the cost model and the command line share."""
import pytest

from shardc.dsl.errors import ShardcError
from shardc.dsl.quantities import parse_bytes, parse_memory, parse_rate, parse_seconds, whole_bytes


def test_byte_sizes_read_in_any_case():
    assert parse_bytes("64KiB") == 65536 and parse_bytes("16 mb") == 16e6 and parse_bytes("4096") == 4096
    assert parse_memory("80GiB") == 80 * 2**30 and parse_memory(" 1.5 tb ") == 1.5e12
    assert parse_bytes("lots") is None and parse_bytes("4 KiBs") is None


def test_a_malformed_number_is_a_refusal_not_a_traceback():
    assert parse_bytes("1.2.3GiB") is None
    with pytest.raises(ShardcError, match=r"cannot read memory size '1\.2\.3GiB'"):
        parse_memory("1.2.3GiB")


def test_rates_and_seconds():
    assert parse_rate("100GB/s") == 100e9 and parse_rate("8Gibit/s") == 2**30
    assert parse_seconds("5us") == pytest.approx(5e-6) and parse_seconds("2e-5") == pytest.approx(2e-5)


def test_whole_bytes_takes_the_largest_exact_unit():
    assert whole_bytes(25_000_000) == (25, "MB") and whole_bytes(2 * 2**20) == (2, "MiB")
    assert whole_bytes(100) == (100, "B") and whole_bytes(3 * 2**30) == (3, "GiB")
