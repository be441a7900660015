"""Planner — search every scope assignment on a mesh and rank it (docs/explain.md).

Input: a mesh, the model's unit sizes, a memory budget per rank and a bandwidth model.
Output: `Candidate`s — one per assignment of params ⊆ grads ⊆ optim level sets —
ranked by estimated step time among those that fit, and the `.shard` text of any.

[Note: the search space]
The dependency rule levels(params) ⊆ levels(grads) ⊆ levels(optim) (Lins eq. 3–4)
lets every mesh level independently be in no scope, in optim only, in grads and
optim, or in all three: 4^L assignments on an L-level mesh (16 on node > gpu). Lins
eq. 5–6 (factors divide the mesh) hold by construction because scopes are sets of
whole levels; a partial factor such as s_p = 4 of 8 GPUs is expressed by splitting a
level in the mesh given to the planner (`gpu(2) > lane(4)`). Lins eq. 7 (prefer
inner levels) is not a filter: the time model already charges the slow outer links.
Memory = the peak per rank (`costmodel/activations.py`: model states + the transient
window of gathered units + one micro-batch's activations + framework overhead); a
candidate fits when that is at most the budget. The model's traced graph is required:
a sum without the activations is no peak, and nothing is filtered by one.

[Note: objective]
`time` (the default) ranks the fitting candidates by predicted step time (ties — equal to
6 significant digits, as when compute hides all but microseconds — by summed
communication time). `comm` ranks by summed
communication time before overlap — Lins' objective (§IV-C: minimise the
communication cost subject to memory) — then step time. Remaining ties go to the
candidate that shards least (p·g·os: sharding a state that fits buys nothing and
adds collectives to launch), then to the smaller peak memory.

[Note: whole-matrix optimizers in the plan]
With `matrices` (a glob over units, e.g. "transformer.h.*") the matrices of those units
are stepped by a whole-matrix optimizer (torch.optim.Muon) and the rest by the
element-wise `optimizer` (the way Muon users pair it with AdamW). A candidate whose optim
scope is sharded gets `override GLOB { optim shard over LEVELS by tensor }` over its optim
levels (a whole-matrix optimizer cannot run on flat chunks): its ledger, memory and step
time are explain's for tensor ownership (analysis/costmodel/owned.py `explain_owned`: the
owners' all-to-alls, every rank's states, the most-loaded owner's Newton–Schulz). A
candidate with `optim replicate` runs every matrix's Newton–Schulz on every rank: that
compute is added to its step time. The search space is unchanged (4^L).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import STATES, Collectives, DType, GradsSpec, Mesh, OptimSpec, ParamsSpec, Scopes, Strategy
from shardc.dsl.quantities import duration
from shardc.dsl.unparse import unparse
from shardc.lowering import kinds_of
from shardc.lowering.optimizers import DEFAULT_OPTIMIZER

from shardc.analysis.costmodel.report import Explained, explain
from shardc.analysis.costmodel.sizes import UnitSize

# Which scopes a level joins, for each of its four choices: a tail of STATES (the
# dependency rule), from none to all three.
CHOICES = tuple(STATES[i:] for i in range(len(STATES), -1, -1))


def enumerate_scopes(mesh: Mesh, dtype: DType = DType.FP32) -> list[Scopes]:
    """Every dependency-rule-respecting assignment of level sets (4^L of them)."""
    out = []
    for pick in itertools.product(range(len(CHOICES)), repeat=len(mesh.names)):
        sets = {k: tuple(l for l, c in zip(mesh.names, pick) if k in CHOICES[c])
                for k in STATES}
        out.append(Scopes(ParamsSpec(sets["params"], comm=dtype, dtype=dtype),
                          GradsSpec(sets["grads"], comm=dtype, dtype=dtype),
                          OptimSpec(sets["optim"])))
    return out


@dataclass(frozen=True, slots=True)
class Candidate:
    scopes: Scopes
    report: Explained
    fits: bool

    @property
    def step_time(self) -> float:
        return self.report.time.total

    @property
    def comm_time(self) -> float:
        """Communication seconds before overlap (Lins' objective; breaks compute-bound ties)."""
        return sum(self.report.time.comm.values())

    @property
    def memory(self) -> int:
        """The peak per rank: states + gathered units + activations + overhead (activations.py)."""
        return self.report.peak["peak"]


    @property
    def sharding(self) -> int:
        """p·g·os: how much is sharded (ties go to the least: sharding what fits buys nothing)."""
        sc, mesh = self.scopes, self.report.strategy.mesh
        return mesh.factor(sc.params.levels) * mesh.factor(sc.grads.levels) * mesh.factor(sc.optim.levels)


def _s(x: float) -> float:
    """Seconds to 6 significant digits: float noise and sub-ppm differences (a tail of
    microseconds under a compute-bound step) must not break a tie."""
    return float(f"{x:.6g}")


OBJECTIVES = {   # [Note: objective]
    "time": lambda c: (_s(c.step_time), _s(c.comm_time), c.sharding, c.memory),
    "comm": lambda c: (_s(c.comm_time), _s(c.step_time), c.sharding, c.memory),
}


def plan(base: Strategy, units: list[UnitSize], budget: float, *, bandwidth=None, micro_batches=None,
         optimizer: str = DEFAULT_OPTIMIZER, optimizer_kwargs=None, dtype: DType = DType.FP32,
         tokens: int = 4096, flops: float = 150e12, graph=None, checkpoint: bool = False,
         peak_flops: float = 312e12, objective: str = "time", overhead: int | None = None,
         matrices: str | None = None, model=None) -> list[Candidate]:
    """All candidates: the fitting ones first, ranked by `objective` ([Note: objective]);
    then the rest by memory. `graph` (the model's traced `GraphCost`) is required: the
    budget bounds the peak, and there is no peak without activations. `matrices` (a unit
    glob) with `model` (a meta model will do): those units' matrices are stepped whole
    ([Note: whole-matrix optimizers in the plan])."""
    if graph is None:
        raise ShardcError("the planner bounds the peak memory per rank, which counts the activations: it needs "
                          "the model's traced graph (graph=flops.trace(...))")
    out = []
    for sc in enumerate_scopes(base.mesh, dtype):
        s = replace(base, scopes=sc, overrides=(), collectives=Collectives.AUTO)
        now = {k.over: k for k in kinds_of(s)}     # an experts statement without a block: the candidate's scopes
        us = [replace(u, scopes=sc, placed=tuple((now.get(k.over, k), t, f) for k, t, f in u.placed)) for u in units]
        rep = explain(s, us, micro_batches=micro_batches, optimizer=optimizer,
                      optimizer_kwargs=optimizer_kwargs, bandwidth=bandwidth, tokens=tokens, flops=flops,
                      graph=graph, checkpoint=checkpoint, peak_flops=peak_flops, overhead=overhead)
        chosen = replace(s, collectives=rep.algo)
        rep = replace(rep, strategy=chosen)
        if matrices is not None:
            rep = _whole_matrices(rep, matrices, model, optimizer, flops, bandwidth)
        out.append(Candidate(sc, rep, rep.peak["peak"] <= budget))
    fit = sorted((c for c in out if c.fits), key=OBJECTIVES[objective])
    rest = sorted((c for c in out if not c.fits), key=lambda c: c.memory)
    return fit + rest


def _whole_matrices(rep: Explained, glob: str, model, optimizer: str, flops: float, bandwidth) -> Explained:
    """`rep` with the units `glob` names stepped by Muon on whole matrices ([Note:
    whole-matrix optimizers in the plan])."""
    from dataclasses import replace as _r

    from shardc.analysis.costmodel.memory import optimizer_state_bytes
    from shardc.analysis.costmodel.owned import explain_owned, ns_step_flops
    from shardc.dsl.ir import Granularity, Override
    from shardc.lowering.optimizers import OWNED_OPTIMIZER
    if model is None:
        raise ShardcError("planning whole-matrix optimizer states needs the model's parameter shapes (model=...)")
    s = rep.strategy
    levels = s.scopes.optim.levels
    if levels:
        owned = _r(s, overrides=(Override(glob, optim=OptimSpec(levels, granularity=Granularity.TENSOR)),))
        e, _ = explain_owned(_r(rep, strategy=owned), model, k_flat=optimizer_state_bytes(optimizer),
                             k_owned=optimizer_state_bytes(OWNED_OPTIMIZER), flops=flops, bandwidth=bandwidth)
        more = e.memory["total"] - rep.memory["total"]        # the largest rank's states, not the flat ones
        return _r(e, peak={**rep.peak, "peak": rep.peak["peak"] + more})
    from fnmatch import fnmatchcase
    every = sum(ns_step_flops(p.shape) for n, p in model.named_parameters()
                if p.dim() == 2 and p.requires_grad and fnmatchcase(n.rsplit(".", 1)[0], glob))
    if not flops or rep.time is None:
        return rep
    t = _r(rep.time, compute=rep.time.compute + every / flops, total=rep.time.total + every / flops)
    elems = sum(p.numel() for n, p in model.named_parameters()
                if p.dim() == 2 and p.requires_grad and fnmatchcase(n.rsplit(".", 1)[0], glob))
    less = (optimizer_state_bytes(optimizer) - optimizer_state_bytes(OWNED_OPTIMIZER)) * elems
    memory = {**rep.memory, "optim": rep.memory["optim"] - less, "total": rep.memory["total"] - less}
    return _r(rep, time=t, memory=memory, peak={**rep.peak, "peak": rep.peak["peak"] - less})


def why(best: Candidate, runner: Candidate, objective: str = "time") -> str:
    """One line: why `best` ranks above `runner` under `objective`."""
    a, b = best.report.time, runner.report.time
    ka, kb = OBJECTIVES[objective](best), OBJECTIVES[objective](runner)
    if ka[:2] == kb[:2]:
        return (f"#1 and #2 tie on communication ({duration(best.comm_time)}) and step time "
                f"({duration(a.total)}); #1 shards less (p·g·os {best.sharding} vs {runner.sharding})"
                if ka[2] != kb[2] else
                f"#1 and #2 tie on time and sharding; #1 needs less memory ({best.memory:,} vs {runner.memory:,} bytes)")
    if objective == "comm":
        return (f"#1 beats #2 on summed communication time: {duration(best.comm_time)} vs "
                f"{duration(runner.comm_time)} (Lins' objective; predicted steps {duration(a.total)} vs {duration(b.total)})")
    if _s(a.total) < _s(b.total):
        head = (f"#1 beats #2 by {duration(b.total - a.total)} per step: exposed communication "
                f"{duration(a.exposed)} vs {duration(b.exposed)}")
        more = {k: b.comm[k] - a.comm[k] for k in a.comm}
        phase = max(more, key=more.get)
        if more[phase] <= 0:
            return head + (f"; #1 sends no less in any phase ({duration(best.comm_time)} vs "
                           f"{duration(runner.comm_time)} before overlap) but hides more of it behind compute")
        return head + (f"; #2 sends {duration(more[phase])} more in the {phase} phase "
                       f"({duration(b.comm[phase])} vs {duration(a.comm[phase])} before overlap)")
    return (f"#1 and #2 tie on step time ({duration(a.total)}: compute hides their communication); "
            f"#1 sends less: {duration(best.comm_time)} vs {duration(runner.comm_time)} of communication")


def shard_text(c: Candidate, name: str = "planned") -> str:
    """The candidate as a `.shard` file (it loads with `shardc check`)."""
    s = replace(c.report.strategy, name=name, accumulate=c.report.micro_batches)
    t = c.report.time
    return (f"# written by `shardc plan`: estimated step {duration(t.total)}, "
            f"{c.memory / 2**30:.2f} GiB peak per rank\n" + unparse(s))
