"""Faults and timeouts — stage: runtime.

Input: the shardc timeout (`shardc.compile(..., timeout=...)`, `shard_module(..., timeout=...)`
or the `SHARDC_TIMEOUT` environment variable, in seconds; default `DEFAULT_TIMEOUT_S`),
the default process group's store.
Output: `enter_collective(sm, name)`, a bounded rendezvous before the collective APIs users
call outside the training step (`full_state_dict()`, `load_state_dict()`, ...): a rank
calling one alone gets an error naming it instead of a silent hang; `timeout_s()`.

[Note: entry rendezvous]
Each ShardedModule gets a key prefix from a per-process counter (every rank shards the
same models in the same order, so the prefixes agree). Entering API `name` for the k-th
time adds 1 to the store counter `<prefix>/<name>/<k>` and polls it until it reaches the
world size or the timeout passes; on a timeout the rank takes its 1 back and raises, so a
later, correct call by all ranks still meets.
"""
from __future__ import annotations

import itertools
import os
import time

import torch.distributed as dist

from .errors import RuntimeUsageError

DEFAULT_TIMEOUT_S = 600.0
ENV = "SHARDC_TIMEOUT"
_ids = itertools.count()


def timeout_s(explicit: float | None = None) -> float:
    """The shardc timeout in seconds: `explicit`, else $SHARDC_TIMEOUT, else the default."""
    if explicit is not None:
        value, where = explicit, "timeout"
    else:
        value, where = os.environ.get(ENV, DEFAULT_TIMEOUT_S), f"${ENV}"
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RuntimeUsageError(f"{where} must be a number of seconds, got {value!r}") from None
    if value <= 0:
        raise RuntimeUsageError(f"{where} must be positive, got {value}")
    return value


def new_prefix() -> str:
    return f"shardc/{next(_ids)}"


def enter_collective(sm, name: str) -> None:
    """Wait (bounded by the shardc timeout) until every rank has entered `name`."""
    world = dist.get_world_size()
    if world == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    seq = sm._entries.get(name, 0)
    key = f"{sm._fault_prefix}/{name}/{seq}"
    limit = sm.timeout
    deadline = time.monotonic() + limit
    count, pause = store.add(key, 1), 0.001
    while count < world:
        if time.monotonic() > deadline:
            store.add(key, -1)
            raise RuntimeUsageError(
                f"{name} is a collective: every rank must call it, but only {count} of {world} "
                f"ranks did within {limit:g}s (rank {dist.get_rank()} waited; set the shardc "
                f"timeout or ${ENV} to wait longer)")
        time.sleep(pause)
        pause = min(0.05, pause * 2)
        count = store.add(key, 0)
    sm._entries[name] = seq + 1
