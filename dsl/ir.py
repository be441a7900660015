"""Strategy IR — stage 2 of the pipeline (AST -> **Strategy**).

Input: nothing (these are the types); produced by `shardc.dsl.resolve` from the AST,
consumed by the compiler (units, passes, plan, cost model) and the runtime.

Every class is a small frozen dataclass whose repr reads back as code, so a Strategy
printed in a test failure or a generated file can be pasted into Python.

[Note: level order]
Levels are always stored outermost first, in mesh order, whatever order the user
wrote them in; `world` is expanded to every mesh level. A scope with no levels is
`replicate` (factor 1).

[Note: chunk order]
The chunk a rank holds for a state is indexed by a mixed-radix number over the state's
levels whose digits are ordered params levels first, then the levels grads add, then
the levels optim adds (each group outermost first) — docs/internals.md. `Scopes.chunk_order`
returns that digit order for one state; with the dependency rule it makes the optim
chunk a contiguous slice of the grad chunk, itself a slice of the params chunk.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from math import prod


class CodeEnum(enum.Enum):
    """An enum whose repr reads back as code (`DType.INT8`)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class Collectives(str):
    """A collective algorithm by its strategy keyword: `auto` (the cost model picks) or a
    name `shardc.algorithms` registers (ring, hierarchical, ho-ring, ...: one file each).
    Interned, so `is` compares; its repr reads back as code."""
    __slots__ = ()
    _interned: dict = {}

    def __new__(cls, name):
        name = str(name)
        got = cls._interned.get(name)
        if got is None:
            got = cls._interned[name] = super().__new__(cls, name)
        return got

    @property
    def value(self) -> str:
        return str(self)

    def __repr__(self) -> str:
        return f"Collectives({str(self)!r})"

    def __reduce__(self):
        return (Collectives, (str(self),))


Collectives.AUTO = Collectives("auto")
Collectives.RING = Collectives("ring")
Collectives.HIERARCHICAL = Collectives("hierarchical")
Collectives.HO_RING = Collectives("ho-ring")


class BufferSync(CodeEnum):
    """`buffers broadcast` (DDP's rule: rank 0's buffers everywhere) or `buffers local`."""
    BROADCAST = "broadcast"
    LOCAL = "local"


class DType(CodeEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def bits(self) -> int:
        return {"fp32": 32, "bf16": 16, "fp16": 16, "int8": 8, "int4": 4}[self.value]

    @property
    def quantized(self) -> bool:
        return self in (DType.INT8, DType.INT4)


@dataclass(frozen=True, slots=True)
class Span:
    """Where a piece of source text lives: 1-based line and column, end exclusive."""
    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True, slots=True)
class Level:
    name: str
    size: int


@dataclass(frozen=True, slots=True)
class Mesh:
    levels: tuple[Level, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(l.name for l in self.levels)

    @property
    def world(self) -> int:
        return prod(l.size for l in self.levels)

    def size(self, name: str) -> int:
        return next(l.size for l in self.levels if l.name == name)

    def factor(self, levels: tuple[str, ...]) -> int:
        return prod(self.size(n) for n in levels)

    def ordered(self, levels) -> tuple[str, ...]:
        """`levels` as a tuple in mesh order (outermost first)."""
        s = set(levels)
        return tuple(n for n in self.names if n in s)

    def divided(self, name: str, k: int) -> "Mesh":
        """This mesh with level `name`'s size divided by `k` (the ranks an ep of k leaves)."""
        return Mesh(tuple(Level(l.name, l.size // k) if l.name == name else l for l in self.levels))

    def __str__(self) -> str:
        return " > ".join(f"{l.name}({l.size})" for l in self.levels)


@dataclass(frozen=True, slots=True)
class MeshDims:
    """The dims of a DeviceMesh a strategy binds to (`mesh=` a DeviceMesh): names and sizes,
    outermost first. The strategy's levels bind to them by name (dsl/mesh.py `bind_mesh`)."""
    names: tuple[str, ...]
    sizes: tuple[int, ...]

    def __str__(self) -> str:
        return ", ".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))


@dataclass(frozen=True, slots=True)
class Secondary:
    """ZeRO++ hpZ: a secondary params shard kept after the forward gather."""
    levels: tuple[str, ...]
    quant: DType | None = None      # INT8 / INT4 storage of the secondary copy, or None


@dataclass(frozen=True, slots=True)
class ParamsSpec:
    levels: tuple[str, ...] = ()
    secondary: Secondary | None = None
    comm: DType = DType.FP32          # payload of the params all-gathers
    dtype: DType = DType.FP32         # storage/compute dtype of the params
    line: int = 0                     # strategy line that set it (0 = default)


@dataclass(frozen=True, slots=True)
class GradsSpec:
    levels: tuple[str, ...] = ()
    comm: DType = DType.FP32          # payload of the grads reduce-scatters
    dtype: DType = DType.FP32         # storage dtype of the grad shard
    line: int = 0


class Granularity(CodeEnum):
    """What one rank's share of a sharded state is ([Note: tensor-owned scopes]).
    FLAT: an element range of the unit's flat buffer (ZeRO's chunks, crossing parameter
    boundaries). TENSOR (`shard over LEVELS by tensor`): whole tensors, each owned by one
    rank of the scope's group, the owners balanced across its ranks."""
    FLAT = "element"
    TENSOR = "tensor"


# [Note: tensor-owned scopes]
# `optim shard over LEVELS by tensor`: the optimizer's states of each matrix (a trainable
# 2-D parameter) of the unit live whole on one rank of the LEVELS group, its owner, so an
# optimizer that is not element-wise (torch.optim.Muon) runs on whole tensors. The
# parameters' fp32 master stays the flat chunk over LEVELS (the states are placed by
# tensor, the storage by element); the owners are assigned once, in the plan
# (lowering/owned.py). The rest of the unit (norms, biases) is for an element-wise
# optimizer; its states are owned whole too, balanced by elements (so they do not fall
# unevenly where the flat chunks' boundaries cut the unit).
# The dependency rule holds on the levels: params ⊆ grads ⊆ optim; only `optim` takes
# `by tensor` (a gradient reaches its owner from the grads scope's flat chunks).


@dataclass(frozen=True, slots=True)
class OptimSpec:
    levels: tuple[str, ...] = ()
    line: int = 0
    granularity: Granularity = Granularity.FLAT

    def __post_init__(self):
        if isinstance(self.granularity, str):        # as its repr writes it: granularity='tensor'
            object.__setattr__(self, "granularity", Granularity(self.granularity))

    def __repr__(self) -> str:
        """Reads back as code; the granularity only where it is not the default (element), by
        its word, so emitted modules need no other import."""
        by = f", granularity={self.granularity.value!r}" if self.owned else ""
        return f"OptimSpec(levels={self.levels!r}, line={self.line!r}{by})"

    @property
    def owned(self) -> bool:
        """Whole tensors, each on its owner ([Note: tensor-owned scopes])."""
        return self.granularity is Granularity.TENSOR


@dataclass(frozen=True, slots=True)
class Scopes:
    """The three state scopes of one unit (the strategy's, or an override's)."""
    params: ParamsSpec = ParamsSpec()
    grads: GradsSpec = GradsSpec()
    optim: OptimSpec = OptimSpec()

    def chunk_order(self, state: str) -> tuple[str, ...]:
        """Digit order of the chunk index for `state` ('params'|'grads'|'optim')."""
        p = self.params.levels
        g = tuple(l for l in self.grads.levels if l not in p)
        o = tuple(l for l in self.optim.levels if l not in p and l not in g)
        order = {"params": p, "grads": p + g, "optim": p + g + o}[state]
        mine = set(getattr(self, state).levels)
        return tuple(l for l in order if l in mine)

    def missing(self, inner: str, outer: str) -> tuple[str, ...]:
        """Levels `inner` shards over that `outer` does not (the dependency rule's culprit)."""
        return tuple(l for l in getattr(self, inner).levels if l not in getattr(self, outer).levels)


# The model states a strategy scopes, in dependency order: the fields of `Scopes`.
STATES = tuple(f.name for f in fields(Scopes))

# [Note: dependency rule] levels(params) ⊆ levels(grads) ⊆ levels(optim), checked pair by
# pair (`Scopes.missing`): by the DSL per statement block, by the lowering per unit.
DEPENDENCY = tuple(zip(STATES, STATES[1:]))


class PartialScopes:
    """A block that scopes some of the states over the top-level statements (an override's,
    the experts'): a state it does not mention is None."""
    __slots__ = ()

    def sets(self) -> tuple[str, ...]:
        """The states the block mentions, in dependency order."""
        return tuple(k for k in STATES if getattr(self, k) is not None)


@dataclass(frozen=True, slots=True)
class Override(PartialScopes):
    """An override block; it is partial: a state it does not mention is None (not set by it)."""
    pattern: str                      # glob over unit/module names, e.g. "transformer.h.0"
    params: ParamsSpec | None = None
    grads: GradsSpec | None = None
    optim: OptimSpec | None = None
    line: int = 0


@dataclass(frozen=True, slots=True)
class Experts(PartialScopes):
    """The `experts` statement: the MoE expert parameters (a glob over parameter and module
    FQNs), the expert-parallel degree `ep` and the level it borrows its ranks from (the
    innermost ranks of `level`; `ep` = that level's size: the whole level), and the
    experts' scopes, a partial block over the top-level statements like an override's.

    [Note: the experts' mesh]
    Expert parameters are data-parallel over the ranks ep leaves: the mesh with `level`'s
    size divided by `ep` (`Strategy.expert_mesh`), its levels named as the strategy's. A
    scope over `level` then spans the level's ranks outside ep (1 when ep takes it whole).
    Their gradients are averaged over the whole data-parallel degree, not that mesh's: each
    expert's gradient already sums the tokens routed to it from every ep rank."""
    pattern: str
    ep: int = 1
    level: str = ""                   # the level ep borrows from ("" when ep is 1)
    params: ParamsSpec | None = None
    grads: GradsSpec | None = None
    optim: OptimSpec | None = None
    line: int = 0


class UnitsKind(CodeEnum):
    AUTO = "auto"
    PATTERNS = "patterns"
    TYPE = "type"


@dataclass(frozen=True, slots=True)
class UnitsSpec:
    kind: UnitsKind = UnitsKind.AUTO
    names: tuple[str, ...] = ()       # patterns (PATTERNS) or class names (TYPE)
    line: int = 0


@dataclass(frozen=True, slots=True)
class Strategy:
    name: str
    mesh: Mesh
    scopes: Scopes
    accumulate: int = 1
    prefetch: int = 1
    collectives: Collectives = Collectives.AUTO
    units: UnitsSpec = UnitsSpec()
    bucket: int | None = None         # bytes; 0: no bucketing; None: the compiler's cost model decides
    overrides: tuple[Override, ...] = ()
    file: str = "<string>"            # for `file.shard:LINE` comments in emitted code
    lines: tuple[tuple[str, int], ...] = field(default=())   # statement -> line, e.g. ("mesh", 2)
    warnings: tuple[str, ...] = ()    # rendered warning diagnostics
    buffers: BufferSync = BufferSync.BROADCAST
    experts: Experts | None = None    # the `experts` statement ([Note: the experts' mesh])

    # Convenience accessors used everywhere.
    @property
    def params(self) -> ParamsSpec:
        return self.scopes.params

    @property
    def grads(self) -> GradsSpec:
        return self.scopes.grads

    @property
    def optim(self) -> OptimSpec:
        return self.scopes.optim

    def line_of(self, statement: str) -> int:
        return dict(self.lines).get(statement, 0)

    def factor(self, levels: tuple[str, ...]) -> int:
        return self.mesh.factor(levels)

    @property
    def expert_mesh(self) -> Mesh:
        """The mesh the experts are data-parallel over ([Note: the experts' mesh]); the
        strategy's mesh when there is no `experts` statement or ep is 1."""
        e = self.experts
        return self.mesh if e is None or e.ep == 1 else self.mesh.divided(e.level, e.ep)

    @property
    def expert_scopes(self) -> Scopes:
        """The experts' scopes: the `experts` block over the top-level statements."""
        e = self.experts
        if e is None:
            return self.scopes
        return replace(self.scopes, **{k: getattr(e, k) for k in e.sets()})
