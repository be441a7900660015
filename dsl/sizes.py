"""Byte-size units — stage: shared by the language (`bucket`), the cost model (rates) and
the CLI (memory limits, message sizes).

Input: a unit suffix. Output: its multiplier in bytes. `BYTE_UNITS` is the one table;
the language accepts the exact spellings it lists (`BUCKET_UNITS` in resolve.py: a
strategy file is strict), the command line any case (`byte_scale`), and a rate's
prefix (`G` in `GB/s`, `Gi` in `Gibit/s`) is a unit without its `B` (`prefix_scale`).
"""
from __future__ import annotations

BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

_BY_LOWER = {k.lower(): v for k, v in BYTE_UNITS.items()} | {"": 1}
_BY_PREFIX = {k[:-1].lower(): v for k, v in BYTE_UNITS.items()}


def byte_scale(unit: str) -> int | None:
    """Bytes per `unit` in any case (`gib`, `GiB`; "" is bytes), or None when unknown."""
    return _BY_LOWER.get(unit.lower())


def prefix_scale(prefix: str) -> int | None:
    """The multiplier of a rate's prefix in any case (`g`, `Gi`; "" is 1), or None."""
    return _BY_PREFIX.get(prefix.lower())
