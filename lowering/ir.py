"""Lowered-plan IR — stage 3 of the pipeline (Strategy + unit sizes -> **Lowering**).

Input: nothing (these are the types); produced by `shardc.lowering.lower`, read by the
runtime (flat groups issue their rows, the engine follows the schedule), the cost model
(ledger and memory are sums over the rows) and codegen (the emitted module prints it).

Every class is a small frozen dataclass whose repr reads back as code; kinds are enums
(but `Over`, a value, since a registered placement kind adds one).

[Note: rows]
A `Row` is one logical collective a flat group issues: its phase, op, the levels of its
group (mesh order), the digit order of a rank's position in it, the payload bytes the
ledger records and how often it runs (`Per`). A group issues exactly its rows; the
ledger of a step is the sum of the rows times their counts.

[Note: a group is keyed by its placement]
A flat group is what its parameters share: trainable or frozen, and a `Placement` — its
kind (`Over`: the unit's own scopes on the strategy's mesh, the experts' on theirs, or a
registered kind's), the data-parallel mesh it is placed over, its scopes and shard factors
on it, and so the granularity of its optimizer states (flat chunks, or whole tensors whose
owners are `Lowering.owned`, lowering/owned.py). Every consumer reads a group's mesh,
scopes and factors from its placement and a row's mesh from `Row.over`; none maps a kind
back to a mesh. A new kind is a new `Over` value and the file that says which parameters
it takes and their placement (lowering/placements.py [Note: placement kinds]; the experts':
lowering/experts.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from shardc.dsl.ir import CodeEnum, DType, Granularity, Mesh, Scopes


class Phase(CodeEnum):
    """When a collective runs, in ledger order."""
    FORWARD = "forward"
    BACKWARD = "backward"
    SYNC = "sync"
    UPDATE = "update"


@dataclass(frozen=True, slots=True)
class Over:
    """What a group's parameters are placed over, named: a placement kind (its data-parallel
    mesh and scopes). `Over.DENSE`: the strategy's mesh and the unit's scopes; `Over.EXPERTS`:
    the experts' mesh and scopes (lowering/experts.py, dsl/ir.py [Note: the experts' mesh]);
    a registered kind adds its own (lowering/placements.py). Ledger order: these two, then
    registration order."""
    value: str


Over.DENSE = Over("dense")
Over.EXPERTS = Over("experts")


class Op(CodeEnum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    ALL_TO_ALL = "all_to_all"


class Per(CodeEnum):
    """How often a row runs: per forward, per backward, once per step, per clip call."""
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"
    CLIP = "clip"


@dataclass(frozen=True, slots=True)
class Row:
    phase: Phase
    op: Op
    levels: tuple[str, ...]           # the group's levels, mesh order
    order: tuple[str, ...]            # digit order of a rank's position in the group
    bytes: int                        # payload the ledger records
    per: Per
    comm: DType = DType.FP32          # wire dtype (quantized payloads: INT8/INT4)
    state: str = "params"             # the strategy statement that causes it
    over: Over = Over.DENSE           # the mesh its levels are on (its group's placement's)


@dataclass(frozen=True, slots=True)
class LedgerRecord:
    """One merged ledger line: rows (predicted) or calls (measured) with equal keys, counted.
    `over`: the mesh its levels are on (an `Over` value)."""
    phase: str
    op: str
    levels: tuple[str, ...]
    bytes: int
    count: int
    over: str = Over.DENSE.value


@dataclass(frozen=True, slots=True)
class Factors:
    """Shard factors of one unit's scopes (s_P, s_G, s_OS and the secondary's s_Q)."""
    p: int
    g: int
    os: int
    q: int


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a group's parameters are placed ([Note: a group is keyed by its placement]): the
    data-parallel mesh (`over`, that mesh `mesh`), their scopes on it and the scopes' shard
    factors. Its granularity is the optimizer scope's (flat chunks, or whole tensors). Its
    clip: the strategy-mesh levels whose all-reduce adds its squared norms, and how many
    times that sum meets each of its optimizer slices (lowering/experts.py [Note: clip rows
    of experts]; 1 but for experts whose optim scope leaves out the level ep borrows from)."""
    over: Over
    mesh: Mesh
    scopes: Scopes
    factors: Factors
    clip_levels: tuple[str, ...] = ()
    clip_weight: int = 1

    @property
    def granularity(self) -> Granularity:
        return self.scopes.optim.granularity


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One flat group of a unit: its parameters share `trainable` and `placement` ([Note: a
    group is keyed by its placement])."""
    trainable: bool
    placement: Placement
    phi: int                          # real elements
    n: int                            # padded elements (internals.md "Padding")
    rows: tuple[Row, ...]
    params_bytes: int                 # persistent bytes per rank of each state
    secondary_bytes: int
    grads_bytes: int
    optim_elems: int                  # N / s_OS: elements of the optimizer chunk
    master_bytes: int                 # fp32 master copy (params dtype not fp32)
    gathered_bytes: int               # full params while gathered (0 when s_P = 1)
    # its one parameter's gradient is reduce-scattered as autograd made it, with no flat copy
    # (runtime/groups/storage.py `whole_grad`: one tensor, no padding, grads in the params dtype)
    whole_grad: bool = False
    # its trainable tensors in layout order, each (its index in the model's parameter order,
    # its elements): the optimizer's pieces ((): not known, sizes given without parameters)
    tensors: tuple[tuple[int, int], ...] = ()

    @property
    def key(self) -> tuple[bool, Placement]:
        return self.trainable, self.placement

    @property
    def factors(self) -> Factors:
        return self.placement.factors

    def row(self, phase: Phase, op: Op | None = None) -> Row | None:
        return next((r for r in self.rows if r.phase is phase and (op is None or r.op is op)), None)

@dataclass(frozen=True, slots=True)
class UnitPlan:
    """One unit: its own scopes and their factors on the strategy's mesh, and its groups,
    each with its placement (an expert group's scopes are the experts')."""
    name: str
    scopes: Scopes
    factors: Factors
    groups: tuple[GroupPlan, ...]
    root: bool = False

    @property
    def gathered(self) -> bool:
        return any(g.factors.p > 1 for g in self.groups) if self.groups else self.factors.p > 1


@dataclass(frozen=True, slots=True)
class Stage:
    """Before `unit` runs (forward) or its backward starts: issue these gathers."""
    unit: int
    issue: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Schedule:
    """Forward stages in forward order (root first); backward stages in backward order.
    `sync_early`: units whose step sync (the SYNC rows) is issued as soon as their own
    backward reduce-scatter is in, on the backward that ends the step, instead of with
    every other unit's at the end of that backward (the `early_sync` pass).
    `update_deferred`: units whose update all-gather, issued at opt.step(), is waited only
    right before the unit is next needed (the `defer_update` pass)."""
    forward: tuple[Stage, ...]
    backward: tuple[Stage, ...]
    sync_early: tuple[int, ...] = ()
    update_deferred: tuple[int, ...] = ()

    def stage(self, direction: str, unit: int) -> Stage | None:
        return next((s for s in getattr(self, direction) if s.unit == unit), None)

    def events(self) -> list[tuple[str, int]]:
        """The gather issues and unit runs this schedule asks for, in order, as the engine
        records them: forward then backward (the root is gathered for the whole pass, so
        its stage issues but records no run)."""
        out: list[tuple[str, int]] = []
        for direction, run in (("forward", "run"), ("backward", "backward")):
            for st in getattr(self, direction):
                out += [("issue_gather", j) for j in st.issue]
                out += [(run, st.unit)] if st.unit != 0 else []
        return out


@dataclass(frozen=True, slots=True)
class OwnedTensor:
    name: str                         # canonical parameter FQN
    shape: tuple[int, ...]
    owner: int                        # its owner's position in the group
    flops: int                        # `ns_flops(shape)` for a matrix, 0 for the element-wise remainder

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class OwnedGroup:
    """The tensors whose optimizer states one group of ranks owns (one optim scope placed
    by tensor, lowering/owned.py): its matrices (`matrices`, balanced by Newton–Schulz
    FLOPs) or the rest of its trainable tensors (balanced by elements)."""
    levels: tuple[str, ...]           # the optim scope's levels, mesh order
    order: tuple[str, ...]            # digit order of a position (the master chunks')
    ranks: int
    tensors: tuple[OwnedTensor, ...]  # plan order: units in forward order, their parameters in order
    rows: tuple[Row, ...]             # [Note: owned rows]
    matrices: bool = True             # False: the element-wise remainder (norms, biases)

    def load(self) -> tuple[int, ...]:
        """What the owners are balanced by, per owner position: Newton–Schulz FLOPs per
        iteration for the matrices, elements for the remainder."""
        out = [0] * self.ranks
        for t in self.tensors:
            out[t.owner] += t.flops if self.matrices else t.numel
        return tuple(out)

    def owned_elems(self, position: int) -> int:
        """Elements of the tensors `position` owns (its whole-tensor optimizer states)."""
        return sum(t.numel for t in self.tensors if t.owner == position)

    def imbalance(self) -> float:
        """The most-loaded owner's cost over the mean, minus 1 (0 = perfectly even)."""
        load = self.load()
        mean = sum(load) / len(load)
        return max(load) / mean - 1.0 if mean else 0.0


@dataclass(frozen=True, slots=True)
class OwnedPlan:
    groups: tuple[OwnedGroup, ...] = ()

    def owner_of(self) -> dict[str, tuple[OwnedGroup, OwnedTensor]]:
        return {t.name: (g, t) for g in self.groups for t in g.tensors}

    @property
    def rows(self) -> tuple[Row, ...]:
        return tuple(r for g in self.groups for r in g.rows)


@dataclass(frozen=True, slots=True)
class Lowering:
    """The one plan: every unit's groups and rows, the clip rows, the schedule, and the
    owners of the matrices whose optimizer states are placed by tensor (`owned`: a group
    whose placement's granularity is TENSOR has its matrices there, lowering/owned.py)."""
    units: tuple[UnitPlan, ...]
    clip_rows: tuple[Row, ...]
    schedule: Schedule
    owned: OwnedPlan = OwnedPlan()

    def backward_order(self) -> tuple[int, ...]:
        """Units with trainable parameters in the order the backward finishes them: the
        backward stages' units, then the root (its embedding is reached last)."""
        order = [st.unit for st in self.schedule.backward] + [0]
        return tuple(dict.fromkeys(i for i in order if any(g.trainable for g in self.units[i].groups)))
