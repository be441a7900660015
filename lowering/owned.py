"""Tensor owners — stage 3 of the pipeline (Strategy + units + parameter shapes -> **OwnedPlan**).

Input: the strategy's mesh and its units (root first, each with its resolved scopes and
its canonical parameter names) and every parameter's shape and trainability (a meta
model will do). Output: the `OwnedPlan` of the units whose `optim` scope is placed by
tensor (dsl/ir.py [Note: tensor-owned scopes]): per group of ranks, its matrices in a
fixed order with the rank that owns each, the optimizer's compute per owner, and the two
ledger rows of the step (every matrix's parameter and reduced gradient to its owner, the
updated matrix back to the ranks holding its chunks). The runtime (runtime/step/owned.py)
moves exactly these rows; `shardc explain` prints the owners and adds the rows.

[Note: owners balanced by compute]
An optimizer that needs whole matrices spends most of its step in Newton–Schulz
iterations (Muon; Shampoo's and SOAP's preconditioner roots alike), each a few m×n by
n×m products: its cost grows with m·n·min(m, n) (`ns_flops`: 4m²n + 2m³ FLOPs for m ≤ n,
the one count explain's step time multiplies by the iterations), not with the bytes. Owners
are assigned once, here, by the longest-processing-time rule over that cost: matrices
in decreasing cost (ties: plan order), each to the owner with the least cost so far
(ties: the lowest position). The result is deterministic, the same on every rank and in
explain, and its most-loaded owner is within the largest single matrix of the mean.

[Note: owned rows]
The step's two all-to-alls run over the optim scope's group, positions in its chunk
digit order (the order of the master's chunks, so a rank's position is its chunk index).
Their ledger bytes follow the all-to-all convention of the links model
(analysis/costmodel/links.py: each rank's buffer V, V/p to each peer): a rank's mean
share of every matrix, fp32 parameter plus gradient to the owners (Phase.SYNC,
8·Σ m·n / p, rounded down) and the fp32 parameter back (Phase.UPDATE, 4·Σ m·n / p);
each once per optimizer step. A group of one rank has no rows (the owner is the rank
itself).
"""
from __future__ import annotations

from shardc.dsl.ir import Mesh, Scopes

from .ir import Op, OwnedGroup, OwnedPlan, OwnedTensor, Per, Phase, Row

__all__ = ["OwnedGroup", "OwnedPlan", "OwnedTensor", "is_matrix", "ns_flops", "owned_plan", "assign_owners"]

FP32 = 4


def is_matrix(shape, trainable: bool) -> bool:
    """Which parameters a tensor-owned scope places whole: trainable and 2-D."""
    return trainable and len(tuple(shape)) == 2


def ns_flops(shape) -> int:
    """FLOPs of one Newton–Schulz iteration of torch.optim.Muon on an m×n matrix (m ≤ n after
    its transpose): A = X·Xᵀ (2m²n), B = b·A + c·A·A (2m³), X = a·X + B·X (2m²n)."""
    m, n = sorted(tuple(shape))
    return 4 * m * m * n + 2 * m ** 3


def assign_owners(costs: list[int], ranks: int) -> list[int]:
    """Owner position per cost ([Note: owners balanced by compute])."""
    load = [0] * ranks
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner


def owned_plan(mesh: Mesh, units, shapes: dict, trainable: dict) -> OwnedPlan:
    """The owners of the matrices of every unit whose optim scope is by tensor. `units`:
    (name, params, scopes) triples or UnitSpecs, root first; `shapes[fqn]`, `trainable[fqn]`."""
    found: dict[tuple, list[tuple[str, tuple]]] = {}
    for u in units:
        scopes: Scopes = u.scopes
        if not scopes.optim.owned:
            continue
        key = (mesh.ordered(scopes.optim.levels), scopes.chunk_order("optim"))
        for name in u.params:
            shape = tuple(shapes[name])
            if is_matrix(shape, trainable[name]):
                found.setdefault(key, []).append((name, shape))
    groups = []
    for (levels, order), mats in found.items():
        ranks = mesh.factor(levels)
        costs = [ns_flops(s) for _, s in mats]
        owners = assign_owners(costs, ranks)
        tensors = tuple(OwnedTensor(n, s, o, c) for (n, s), o, c in zip(mats, owners, costs))
        elems = sum(t.numel for t in tensors)
        rows = () if ranks == 1 else (
            Row(Phase.SYNC, Op.ALL_TO_ALL, levels, order, 2 * FP32 * elems // ranks, Per.STEP, state="optim"),
            Row(Phase.UPDATE, Op.ALL_TO_ALL, levels, order, FP32 * elems // ranks, Per.STEP, state="optim"))
        groups.append(OwnedGroup(levels, order, ranks, tensors, rows))
    return OwnedPlan(tuple(groups))
