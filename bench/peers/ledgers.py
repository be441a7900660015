"""The peers' communication, from their known algorithms (bench stage: system -> ledger).

Input: a peer system name, the model's unit sizes, the mesh `node(n) > gpu(p)` and the
number of micro-batches M. Output: ledger records in shardc's format (phase, op,
levels, bytes, count per optimizer step), which `shardc.analysis.costmodel.link_bytes`
turns into bytes per rank per level exactly as it does for shardc's own ledger.

[Note: the peers' algorithms, per optimizer step, fp32, Φ_u elements in unit u]
FSDP2 `fully_shard` (every block is a unit, the root holds the rest; the root is not
resharded after forward, so it has no backward all-gather), with the user's
accumulation idiom `set_requires_gradient_sync(False)` on micro-batches 1..M-1:
  - forward:  all_gather 4·Φ_u over the shard dims, every unit, M times
  - backward: all_gather 4·Φ_u over the shard dims, non-root units, M times
  - backward: reduce_scatter 4·Φ_u over the shard dims, every unit, once (last
    micro-batch; before it FSDP2 accumulates unsharded gradients)
  - HSDP only: all_reduce 4·Φ_u/p over the replicate dim (node), every unit, once
  full shard: shard dims = (node, gpu); HSDP: shard dim = gpu, replicate dim = node.
DDP with `no_sync()` on micro-batches 1..M-1: one all_reduce of 4·Φ over (node, gpu)
per step (split into 25 MB buckets; link bytes are linear in the size, so one record).
FSDP2 with EP in torchtitan's layout (`fsdp2+epN`, bench/peers/ep_systems.py [Note: +ep systems]):
each block is two units, its dense parameters over (node, gpu) as above and its experts'
ep shard (Φ_e elements: E/N experts) over the efsdp ranks, the experts' mesh
node(n) > gpu(p / N) (records marked `experts`); the root as above. The token all-to-alls
are the model's, not counted here (the worker's `a2a_bytes`).
All collectives are gloo rings over the flattened group (torch passes the group's
ranks in mesh order), hence `Collectives.RING` in link_bytes. A `+tp` system
(bench/peers/systems.py [Note: +tp systems]) runs the same over its data-parallel mesh
node(n) > gpu(p / tp) with its TP-local unit sizes; DTensor's TP collectives (inside a node)
are not counted.
"""
from __future__ import annotations

from shardc.lowering import LedgerRecord as Rec      # shardc's own record type

from models import block_modules, n_params

WORLD = ("node", "gpu")


def unit_numels(model) -> list[int]:
    """[Φ_root, Φ_block1, ...] in elements (tied parameters counted once)."""
    blocks = [n_params(b) for b in block_modules(model)]
    return [n_params(model) - sum(blocks)] + blocks


def fsdp2_ledger(sizes: list[int], per_node: int, M: int, hybrid: bool) -> list[Rec]:
    shard = ("gpu",) if hybrid else WORLD
    recs: list[Rec] = []
    for u, phi in enumerate(sizes):
        recs.append(Rec("forward", "all_gather", shard, 4 * phi, M))
        if u > 0:
            recs.append(Rec("backward", "all_gather", shard, 4 * phi, M))
        recs.append(Rec("backward", "reduce_scatter", shard, 4 * phi, 1))
        if hybrid:
            recs.append(Rec("sync", "all_reduce", ("node",), 4 * phi // per_node, 1))
    return recs


def fsdp2_ep_ledger(sizes: list[int], expert_sizes: list[int], M: int) -> list[Rec]:
    """`fsdp2+epN`: `fsdp2_ledger` of the dense units, and the experts' units over their
    own mesh's (node, gpu), the same three collectives each (records marked `experts`)."""
    recs = fsdp2_ledger(sizes, 0, M, hybrid=False)
    for phi in expert_sizes:
        recs += [Rec("forward", "all_gather", WORLD, 4 * phi, M, over="experts"),
                 Rec("backward", "all_gather", WORLD, 4 * phi, M, over="experts"),
                 Rec("backward", "reduce_scatter", WORLD, 4 * phi, 1, over="experts")]
    return recs


def ddp_ledger(sizes: list[int]) -> list[Rec]:
    return [Rec("sync", "all_reduce", WORLD, 4 * sum(sizes), 1)]


def peer_ledger(system: str, model, per_node: int, M: int, sizes: list[int] | None = None) -> list[Rec]:
    """The peer's records; `sizes` (elements per unit on one rank) replaces the model's
    where a `+tp` system holds only its TP shards (bench/peers/systems.py `local_unit_numels`),
    with `per_node` then the data-parallel ranks of a node."""
    sizes = sizes or unit_numels(model)
    system = system.split("+")[0]          # +tp, +compile: the same collectives
    if system == "ddp":
        return ddp_ledger(sizes)
    return fsdp2_ledger(sizes, per_node, M, hybrid=system.startswith("fsdp2:hsdp"))
