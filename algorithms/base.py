"""A collective algorithm — stage: below the DSL (pure arithmetic on level names and sizes).

Input: a group's digit key (its levels in the chunk's digit order, size-1 levels dropped),
the mesh's level order (`ordered(levels)`: outermost first) and sizes. Output: the stages
each collective runs — per stage, the group (a digit key) it runs over — and how many
pieces of the chunk run those stages side by side; from them, for the cost model, the
bytes a rank sends over each level's links and the seconds the stages take.

[Note: an algorithm is its stages]
An all-gather of a chunk of m elements runs its stages S1..Sk in order: stage t gathers
over the group of S_t's digits, so the buffer grows to [S_t digits, ..., S_1 digits, m]; the
executor then permutes it to the chunk order (`gather_perm`). A reduce-scatter first
permutes the n-element input to [S_1 digits, ..., S_k digits, m] (`scatter_perm`) and stage
t reduce-scatters over S_t, leaving [S_{t+1} ..., m]. An all-reduce is a `ReducePlan`: the
scatter stages, one all-reduce, the gather stages. With `pieces` = p > 1 the chunk is cut
into p near-equal pieces (`bounds`), each running every stage, so stages of different
pieces are in flight at once. Every algorithm therefore places chunks exactly alike (by
the chunk order), and either executor loads the other's state. Over a single level every
algorithm is one stage, the ring (`resolve`).

[Note: bytes and seconds from the stages]
A stage over levels L with logical volume V (an all-gather's output, a reduce-scatter's
input) is one flat collective: per rank, over level i of L, edges_i/p · F·(p−1)/p · V
(`flat_bytes`: the ring has p edges, (Π_{j<i} p_j)(p_i−1) of them change level i as their
outermost digit, plus the wrap-around on the outermost; F = 2 for an all-reduce; an
all-to-all sends V/p to each of (p_i−1)·Π_{j>i} p_j peers; a broadcast is a chain of p−1
edges each carrying V). An all-gather's stage t moves V_t = V / Π_{u>t} |S_u|, a
reduce-scatter's V_t = V / Π_{u<t} |S_u|. The seconds of the stages combine as
max + (sum − max)/pieces (a sum for one piece: `combine`). All-to-all (qgZ) and broadcast
are always one flat stage.
"""
from __future__ import annotations

import contextlib

from math import prod
from typing import NamedTuple

AUTO = "auto"
FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2, "all_to_all": 1, "broadcast": 1}
_REGISTRY: dict[str, "Algorithm"] = {}


class ReducePlan(NamedTuple):
    """An all-reduce: reduce-scatter stages, one all-reduce over `reduce`, gather stages."""
    scatter: tuple
    reduce: tuple
    gather: tuple


class Algorithm:
    """One collective algorithm (see the module notes). Subclasses set `name` (the
    strategy keyword) and define the three stage rules; `pieces` > 1 pipelines them."""
    name: str = ""
    pieces: int = 1

    def gather(self, key: tuple, ordered) -> tuple:
        """The all-gather's stages over digit key `key`, in issue order."""
        raise NotImplementedError

    def scatter(self, key: tuple, ordered) -> tuple:
        """The reduce-scatter's stages over `key`, in issue order."""
        raise NotImplementedError

    def reduce(self, key: tuple, ordered) -> ReducePlan:
        """The all-reduce's plan over `key`."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"algorithms.get({self.name!r})"

    # -- the cost model ------------------------------------------------------------------------
    def stages(self, op: str, key: tuple, ordered, size, volume: float) -> list[tuple[str, tuple, float]]:
        """[(stage op, stage levels, stage volume)] of one collective of logical `volume`
        over `key` (see [Note: bytes and seconds from the stages]); `size(level)`."""
        if op in ("all_to_all", "broadcast") or len(key) < 2:
            return [(op, key, volume)]
        if op == "all_gather":
            st = self.gather(key, ordered)
            return [(op, s, volume / prod(_n(size, u) for u in st[t + 1:])) for t, s in enumerate(st)]
        if op == "reduce_scatter":
            st = self.scatter(key, ordered)
            return [(op, s, volume / prod(_n(size, u) for u in st[:t])) for t, s in enumerate(st)]
        plan = self.reduce(key, ordered)
        out, v = [], volume
        for s in plan.scatter:
            out.append(("reduce_scatter", s, v))
            v /= _n(size, s)
        out.append(("all_reduce", plan.reduce, v))
        for s in plan.gather:
            v *= _n(size, s)
            out.append(("all_gather", s, v))
        return out

    def combine(self, seconds: list[float]) -> float:
        """The seconds of the stages together ([Note: bytes and seconds from the stages])."""
        if not seconds:
            return 0.0
        top = max(seconds)
        return top + (sum(seconds) - top) / self.pieces if self.pieces > 1 else sum(seconds)


def _n(size, levels) -> int:
    return prod(size(lvl) for lvl in levels)


def flat_bytes(op: str, sizes: list[tuple[str, int]], v: float) -> dict[str, float]:
    """Per-rank bytes per level of one flat collective of volume `v` over levels `sizes`
    ([(level, size)], mesh order, sizes > 1)."""
    p = prod(s for _, s in sizes)
    out: dict[str, float] = {}
    if p <= 1:
        return out
    if op == "broadcast":                         # a chain of p − 1 edges, each carrying the whole v
        outer = 1
        for name, s in sizes:
            out[name] = outer * (s - 1) * v / p
            outer *= s
        return out
    outer = 1
    for i, (name, s) in enumerate(sizes):
        inner = prod(x for _, x in sizes[i + 1:])
        if op == "all_to_all":
            out[name] = (s - 1) * inner * v / p
        else:
            edges = outer * (s - 1) + (1 if i == 0 else 0)
            out[name] = FACTOR[op] * edges / p * (p - 1) / p * v
        outer *= s
    return out


# -- the executors' arithmetic --------------------------------------------------------------------
def gather_perm(stages: tuple, key: tuple) -> list[int]:
    """The permutation of a gathered buffer, dims [S_k digits, ..., S_1 digits, piece], to
    [key digits, piece]."""
    names = [d for s in reversed(stages) for d in s]
    return [names.index(n) for n in key] + [len(names)]


def scatter_perm(stages: tuple, key: tuple) -> list[int]:
    """The permutation of an input, dims [key digits, m], to [S_1 digits, ..., S_k digits, m]."""
    names = [d for s in stages for d in s]
    return [list(key).index(n) for n in names] + [len(key)]


def bounds(m: int, k: int) -> list[tuple[int, int]]:
    """[lo, hi) of k near-equal pieces of m elements (at most m of them)."""
    k = max(1, min(k, m))
    step, extra = divmod(m, k)
    out, lo = [], 0
    for i in range(k):
        hi = lo + step + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


# -- the registry ------------------------------------------------------------------------------------
# [Note: a read-only registry]
# The shipped algorithms register while shardc.algorithms is imported (`register`); the
# package then seals the registry (`_seal`), so what `auto` chooses among and what a
# strategy may name is fixed for the process. Any other algorithm (a test's, a user's
# experiment) is registered for a scope: `with registered(MyAlgorithm): ...` adds it for the
# block and removes it after, so it never stays an `auto` candidate for the rest of the process.
_SEALED: list[bool] = [False]


def _check_name(cls) -> None:
    if not cls.name or cls.name == AUTO:
        raise ValueError(f"an algorithm needs a name other than {AUTO!r}")
    if cls.name in _REGISTRY:
        raise ValueError(f"an algorithm named {cls.name!r} is already registered")


def register(cls):
    """Class decorator for the shipped algorithms: make `cls()` the algorithm of its `name`
    (only while shardc.algorithms is imported: see [Note: a read-only registry])."""
    if _SEALED[0]:
        raise RuntimeError(f"the algorithm registry is read-only after import: register {cls.__name__} "
                           f"for a scope with `with shardc.algorithms.registered({cls.__name__}): ...`")
    _check_name(cls)
    _REGISTRY[cls.name] = cls()
    return cls


def _seal() -> None:
    _SEALED[0] = True


@contextlib.contextmanager
def registered(*classes):
    """Within the block, `classes` are registered algorithms too (see [Note: a read-only registry])."""
    for cls in classes:
        _check_name(cls)
    added = [cls.name for cls in classes]
    try:
        for cls in classes:
            _REGISTRY[cls.name] = cls()
        yield
    finally:
        for name in added:
            _REGISTRY.pop(name, None)


def get(name: str) -> Algorithm:
    return _REGISTRY[str(name)]


def names() -> tuple[str, ...]:
    """Every registered algorithm's name (what `collectives` takes besides `auto`)."""
    return tuple(_REGISTRY)


# [Note: what `auto` means]
# `collectives auto` asks for the registered algorithm with the least total communication
# time for the strategy on its links. The cost model makes that choice when it plans
# (analysis/costmodel/timing.py `choose_collectives`, the one place that compares
# algorithms), and the plan then names the algorithm it chose. Where `auto` is read before
# or without that choice, it stands for the algorithm `stand_in` names, and only here:
#   * RUN: a collective run under a strategy that still says `auto` (built without a
#     plan) runs the hierarchical algorithm (on a single level every algorithm is the ring);
#   * PROBE: bucketing's size probe (analysis/costmodel/bucketing.py), which feeds the
#     choice and so cannot wait for it, prices a unit's collectives over the ring.
RUN, PROBE = "run", "probe"
_STAND_INS = {RUN: "hierarchical", PROBE: "ring"}


def stand_in(name: str, use: str = RUN) -> str:
    """`name`, or for `auto` the algorithm it stands for in `use` (see [Note: what `auto` means])."""
    return _STAND_INS[use] if str(name) == AUTO else str(name)


def resolve(name: str, key: tuple) -> Algorithm:
    """The algorithm a collective over `key` runs: a single level is always the ring; a
    leftover `auto` is its stand-in (see [Note: what `auto` means])."""
    if len(key) < 2:
        return _REGISTRY["ring"]
    return _REGISTRY[stand_in(name)]
