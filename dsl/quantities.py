"""Quantities — stage: shared by every layer; bytes, rates and seconds read from text and
written for people.

Input: a number with its unit as the user typed it (`80GiB`, `25Gbit/s`, `5us`), or a
number to show. Output: bytes, bytes per second or seconds (or `ShardcError` with the
spelling to use), and text such as `1.5 GiB`, `200 TFLOP/s`, `12.3 us`. Every reader and
writer of these units lives here; the language, the cost model and the command line call
them.

[Note: unit spellings]
`BYTE_UNITS` is the one table of byte units. The language accepts exactly the spellings
`BUCKET_UNITS` lists (a strategy file is strict; `bucket` stays ≤ 1 TiB); the command
line reads any case (`gib`, `GiB`, and "" for bytes), and a rate's prefix (`G` in
`GB/s`, `Gi` in `Gibit/s`) is a byte unit without its `B`. A number without a unit is
bytes, bytes per second or seconds; where that is implausible (a memory limit, a rate
below 1 MB/s, a latency of a second or more per ring step) it is refused as a missing
unit, with the spelling to write.
"""
from __future__ import annotations

import re

from shardc.dsl.errors import ShardcError

BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
BUCKET_UNITS = {u: BYTE_UNITS[u] for u in ("B", "KB", "MB", "GB", "KiB", "MiB", "GiB")}
SECOND_UNITS = {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}

_BY_LOWER = {k.lower(): v for k, v in BYTE_UNITS.items()} | {"": 1}
_BY_PREFIX = {k[:-1].lower(): v for k, v in BYTE_UNITS.items()}
_BYTES = re.compile(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*")
_RATE = re.compile(r"\s*([0-9.eE+-]+)\s*([kKmMgGtT]i?)?(B|bit|b)?(/s)?\s*")
_SECONDS = re.compile(r"\s*([0-9.eE+-]+)\s*(s|ms|us|ns)?\s*")
_MEMORY_HINT = "write e.g. 80GiB or 40GB"


def byte_scale(unit: str) -> int | None:
    """Bytes per `unit` in any case (`gib`, `GiB`; "" is bytes), or None when unknown."""
    return _BY_LOWER.get(unit.lower())


def _number(text: str | None) -> float:
    """`text` as a float, or -1 when it is none (every quantity read here is ≥ 0)."""
    try:
        return float(text) if text is not None else -1.0
    except ValueError:
        return -1.0


def split_bytes(text: str) -> tuple[str, str] | None:
    """(number, unit) of a byte size as written (`'80', 'GiB'`; unit "" for none), or None
    when `text` is not one (an unknown unit or an unreadable number included)."""
    m = _BYTES.fullmatch(str(text))
    if not m or byte_scale(m.group(2)) is None or _number(m.group(1)) < 0:
        return None
    return m.group(1), m.group(2)


def parse_bytes(text: str) -> float | None:
    """'64KiB', '16MB', '4096' -> bytes (a bare number is bytes), or None when unreadable."""
    q = split_bytes(text)
    return None if q is None else float(q[0]) * byte_scale(q[1])


def parse_memory(text: str) -> float:
    """A memory size per rank, '80GiB' -> bytes; a positive number with a unit."""
    q = split_bytes(text)
    if q is None:
        raise ShardcError(f"cannot read memory size {text!r}; {_MEMORY_HINT}")
    number, unit = q
    if float(number) <= 0:
        raise ShardcError(f"memory size {text!r} must be positive; {_MEMORY_HINT}")
    if not unit:
        raise ShardcError(f"memory size {text!r} has no unit; write e.g. {number}GiB or {number}GB "
                          f"(B, KB/KiB, MB/MiB, GB/GiB or TB/TiB)")
    return float(number) * byte_scale(unit)


def parse_rate(text: str) -> float:
    """'100GB/s', '25Gbit/s', '12.5e9' -> bytes per second. A number without a unit is
    bytes per second, so one below 1 MB/s (`--link node=25`) is refused as a missing unit."""
    m = _RATE.fullmatch(str(text))
    value = _number(m.group(1) if m else None)
    if value <= 0:
        raise ShardcError(f"cannot read bandwidth {text!r}; write e.g. 100GB/s or 25Gbit/s")
    if not (m.group(2) or m.group(3)) and value < 1e6:
        raise ShardcError(f"bandwidth {text.strip()!r} has no unit, so it reads as {value:g} bytes/s; "
                          f"write e.g. {value:g}GB/s or {value:g}Gbit/s")
    scale = _BY_PREFIX[(m.group(2) or "").lower()]
    bits = m.group(3) in ("bit", "b")
    return value * scale / (8 if bits else 1)


def parse_seconds(text: str) -> float:
    """'5us', '0.1ms', '2e-5' -> seconds. A number without a unit is seconds, so one of
    a second or more per ring step (`@20`) is refused as a missing unit."""
    m = _SECONDS.fullmatch(str(text))
    value = _number(m.group(1) if m else None)
    if value < 0:
        raise ShardcError(f"cannot read latency {text!r}; write e.g. 5us or 0.1ms")
    if m.group(2) is None and value >= 1:
        raise ShardcError(f"latency {text.strip()!r} has no unit, so it reads as {value:g} s per ring step; "
                          f"write e.g. {value:g}us or {value:g}ms")
    return value * SECOND_UNITS.get(m.group(2), 1)


def whole_bytes(n: int) -> tuple[int, str]:
    """`n` > 0 bytes in the largest `BUCKET_UNITS` unit that divides them exactly:
    (25, 'MB'), (2, 'MiB'), (100, 'B')."""
    unit = max((u for u, m in BUCKET_UNITS.items() if n % m == 0), key=BUCKET_UNITS.get)
    return n // BUCKET_UNITS[unit], unit


def scaled(value: float, units: tuple[str, ...], step: float) -> str:
    """`value` (in `units[0]`) with three significant digits in the first unit where it
    rounds below 1000, each unit `step` times the one before; whole in the last unit
    beyond it (no exponents: 1000 MiB is '0.977 GiB', not '1e+03 MiB')."""
    for unit in units[:-1]:
        if abs(value) < 999.5:
            return f"{value:.3g} {unit}"
        value /= step
    return f"{value:.3g} {units[-1]}" if abs(value) < 999.5 else f"{value:.0f} {units[-1]}"


def human_bytes(n: float) -> str:
    """Whole bytes below 1 KiB, else binary units with three significant digits (1.5 GiB)."""
    return f"{n:.0f} B" if abs(n) < 1024 else scaled(n / 1024, ("KiB", "MiB", "GiB", "TiB"), 1024)


def flop_rate(flops: float) -> str:
    """FLOP/s as people read them: '17.6 GFLOP/s', '200 TFLOP/s'."""
    return scaled(flops / 1e9, ("GFLOP/s", "TFLOP/s", "PFLOP/s"), 1000)


def duration(seconds: float) -> str:
    """Seconds as people read them: '12.3 us' below 1 ms, '1101.5 ms' below 10 s, '755.92 s'
    above (the planner's and `explain`'s printed times; JSON keeps seconds)."""
    if seconds != 0 and abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.1f} us"
    return f"{seconds * 1e3:.1f} ms" if abs(seconds) < 10 else f"{seconds:.2f} s"
