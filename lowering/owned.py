"""Tensor owners — stage 3 of the pipeline (Strategy + units + parameter shapes -> **OwnedPlan**).

Input: the strategy's mesh and its units (root first, each with its resolved scopes and
its canonical parameter names) and every parameter's shape and trainability (a meta
model will do). Output: the `OwnedPlan` of the units whose `optim` scope is placed by
tensor (dsl/ir.py [Note: tensor-owned scopes]): per group of ranks, its matrices in a
fixed order with the rank that owns each and the optimizer's compute per owner, its other
trainable tensors (the element-wise remainder: norms, biases) with theirs, and per group
the two ledger rows of the step (every tensor's parameter and reduced gradient to its
owner, the updated tensor back to the ranks holding its chunks). The runtime
(runtime/step/owned.py) moves exactly these rows; `shardc explain` prints the owners and
adds the rows.

[Note: owners balanced by compute]
An optimizer that needs whole matrices spends most of its step in Newton–Schulz
iterations (Muon; Shampoo's and SOAP's preconditioner roots alike), each a few m×n by
n×m products: its cost grows with m·n·min(m, n) (`ns_flops`: 4m²n + 2m³ FLOPs for m ≤ n,
the one count explain's step time multiplies by the iterations), not with the bytes. Owners
are assigned once, here, by the longest-processing-time rule over that cost: matrices
in decreasing cost (ties: plan order), each to the owner with the least cost so far
(ties: the lowest position). The result is deterministic, the same on every rank and in
explain, and its most-loaded owner is within the largest single matrix of the mean.

[Note: the element-wise remainder is owned too]
A by-tensor unit's other trainable tensors (norms, biases: what Muon users step with
AdamW) are owned whole as well, in a group of their own over the same ranks, balanced by
their elements with the same rule (ties alike). Left in the flat chunks, their element-wise
states fell where the chunk boundaries cut the unit: on the bench GPT's blocks 1,024,
1,536, 2,048 and 512 of each block's 5,120 such elements on the four ranks, so the
largest rank held 24,576 B more than FSDP2, which gives every rank a quarter of each
tensor. Owned by elements, each rank of the bench GPT holds 5,120 at 4 ranks and 2,560 at
8: the mean, exactly. An element-wise optimizer steps them whole on their owners (it
gives the same values as on chunks); the cost is their bytes in the two all-to-alls
(12 B per element over the group's ranks, once per step).

[Note: owned rows]
The step's two all-to-alls run over the optim scope's group, positions in its chunk
digit order (the order of the master's chunks, so a rank's position is its chunk index).
Their ledger bytes follow the all-to-all convention of the links model
(analysis/costmodel/links.py: each rank's buffer V, V/p to each peer): a rank's mean
share of every tensor of the group, fp32 parameter plus gradient to the owners
(Phase.SYNC, 8·Σ numel / p, rounded down) and the fp32 parameter back (Phase.UPDATE,
4·Σ numel / p); each once per optimizer step, per group (the matrices' and the
remainder's: each optimizer moves the groups of the tensors it steps). A group of one
rank has no rows (the owner is the rank itself).
"""
from __future__ import annotations

from shardc.dsl.ir import Mesh, Scopes

from .ir import Op, OwnedGroup, OwnedPlan, OwnedTensor, Per, Phase, Row

__all__ = ["OwnedGroup", "OwnedPlan", "OwnedTensor", "is_matrix", "ns_flops", "owned_plan", "assign_owners",
           "owned_rows"]

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


def owned_rows(levels, order, ranks: int, elems: int) -> tuple[Row, ...]:
    """The step's two all-to-all rows of an owner group of `elems` elements ([Note: owned rows])."""
    return () if ranks == 1 else (
        Row(Phase.SYNC, Op.ALL_TO_ALL, levels, order, 2 * FP32 * elems // ranks, Per.STEP, state="optim"),
        Row(Phase.UPDATE, Op.ALL_TO_ALL, levels, order, FP32 * elems // ranks, Per.STEP, state="optim"))


def owned_plan(mesh: Mesh, units, shapes: dict, trainable: dict) -> OwnedPlan:
    """The owners of the trainable tensors of every unit whose optim scope is by tensor: per
    scope a group of its matrices and one of the rest ([Note: the element-wise remainder is
    owned too]). `units`: (name, params, scopes) triples or UnitSpecs, root first;
    `shapes[fqn]`, `trainable[fqn]`."""
    found: dict[tuple, list[tuple[str, tuple]]] = {}
    for u in units:
        scopes: Scopes = u.scopes
        if not scopes.optim.owned:
            continue
        key = (mesh.ordered(scopes.optim.levels), scopes.chunk_order("optim"))
        for name in u.params:
            shape = tuple(shapes[name])
            if trainable[name]:
                found.setdefault(key + (is_matrix(shape, True),), []).append((name, shape))
    groups = []
    for matrices in (True, False):               # the matrices' groups first, then the remainders'
        for (levels, order, kind), found_ in found.items():
            if kind != matrices:
                continue
            ranks = mesh.factor(levels)
            flops = [ns_flops(s) if matrices else 0 for _, s in found_]
            owners = assign_owners(flops if matrices else [_numel(s) for _, s in found_], ranks)
            tensors = tuple(OwnedTensor(n, s, o, c) for (n, s), o, c in zip(found_, owners, flops))
            rows = owned_rows(levels, order, ranks, sum(t.numel for t in tensors))
            groups.append(OwnedGroup(levels, order, ranks, tensors, rows, matrices))
    return OwnedPlan(tuple(groups))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
