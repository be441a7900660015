"""Explain pipeline — strategy + model -> one `Explained` report (shared by the CLI,
the planner and tests).

Input: a loaded Strategy and either a model (built on the meta device) or unit sizes.
Output: `Explained`: memory per rank, the predicted ledger, the collective algorithm
resolved for multi-level groups, per-level link bytes (intra/inter split) and, when a
bandwidth model is given, a step-time estimate with tokens/s and MFU, and the peak
memory per rank (`activations.py`). `to_json` is `explain --json`.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Collectives, Strategy
from shardc.lowering import A2A_RS_BACKENDS, Lowering, Over, kinds_of, lower, placement_meshes
from shardc.lowering.optimizers import BACKEND_DEVICE, DEFAULT_OPTIMIZER

from shardc.analysis.costmodel.activations import FRAMEWORK_OVERHEAD, peak_memory
from shardc.analysis.costmodel.ledger import ledger_dicts, ledger_of
from shardc.analysis.costmodel.links import inter_intra, link_bytes
from shardc.analysis.costmodel.memory import memory_of, optimizer_state_bytes
from shardc.analysis.costmodel.sizes import UnitSize, dense_flops, model_params, model_unit_sizes
from shardc.analysis.costmodel.timing import AlphaBeta, StepTime, choose_collectives, step_time


@dataclass(frozen=True, slots=True)
class Explained:
    strategy: Strategy
    units: tuple[UnitSize, ...]
    micro_batches: int
    memory: dict
    ledger: tuple
    algo: Collectives
    links: dict
    inter: float
    intra: float
    time: StepTime | None
    peak: dict | None = None        # activations.peak_memory: the peak per rank and what dominates it
    rates: dict | None = None       # tokens_per_s (per rank), mfu, model_flops (per micro-batch)
    shared: dict | None = None      # level -> the level whose links carry its traffic, where another's
    plan: Lowering | None = None    # the lowered plan the figures add up (its schedule: what the run follows)


def model_units(strategy: Strategy, model) -> list[UnitSize]:
    """The model's units under `strategy` (the unit finder, with the bucket size the
    compiler resolves) with their sizes."""
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.units import find_units
    return model_unit_sizes(model, find_units(model, resolve_bucket(model, strategy)), kinds_of(strategy))


def explain(strategy: Strategy, units, *, micro_batches: int | None = None, optimizer: str = DEFAULT_OPTIMIZER,
            optimizer_kwargs: dict | None = None, clip_grad_norm: bool = False, bandwidth=None,
            tokens: int = 4096, flops: float = 150e12, graph=None, checkpoint: bool = False,
            peak_flops: float = 312e12, overhead: int | None = None, passes=None,
            backend: str = "nccl", device: str | None = None) -> Explained:
    """Everything `shardc explain` prints, for one strategy on one model. `graph`: the
    model's `flops.GraphCost` (FLOPs and activations per micro-batch), when traced;
    `passes`: the plan passes the run uses (None: all, as `shardc compile` runs them);
    `backend`: the process groups' backend (gloo's reduce-scatters hold receive blocks:
    shardc.lowering A2A_RS_BACKENDS); `device`: where the step's tensors are, for the
    optimizer's implementation (None: the backend's, lowering/optimizers.py `BACKEND_DEVICE`)."""
    m = strategy.accumulate if micro_batches is None else micro_batches
    if m < 1:
        raise ShardcError(f"--micro-batches must be at least 1, got {m}")
    units = tuple(units)
    plan = lower(strategy.mesh, units, strategy.prefetch, passes)  # the one plan, added up twice
    k_state = optimizer_state_bytes(optimizer, **(optimizer_kwargs or {}))
    memory = memory_of(plan, k_state=k_state, prefetch=strategy.prefetch)
    records = ledger_of(plan, forwards=m, backwards=m, clips=int(clip_grad_norm))
    bw = bandwidth or AlphaBeta()
    algo = choose_collectives(strategy, list(units), bandwidth=bw, micro_batches=m)
    links = link_bytes(records, strategy.mesh, algo, placement_meshes(strategy))
    inter, intra = inter_intra(links, strategy.mesh)
    mb_flops = graph.executed_flops(checkpoint) if graph is not None else None
    tokens = graph.tokens if graph is not None else tokens
    t = step_time(strategy, list(units), bw, micro_batches=m, tokens=tokens, flops=flops, algo=algo,
                  mb_flops=mb_flops, passes=passes,
                  unit_flops=graph.unit_forward_flops if graph is not None else None)
    model_flops = graph.model_flops if graph is not None else dense_flops(units, tokens)
    rates = {"tokens_per_s": m * tokens / t.total, "mfu": m * model_flops / (t.total * peak_flops),
             "model_flops": model_flops}
    return Explained(strategy, units, m, memory, tuple(records), algo, links, inter, intra, t,
                     peak_memory(memory, graph, checkpoint, FRAMEWORK_OVERHEAD if overhead is None else overhead, plan, m,
                                 strategy.mesh, algo, optimizer, optimizer_kwargs,
                                 backend in A2A_RS_BACKENDS, device or BACKEND_DEVICE.get(backend, "cuda")), rates,
                     shared_links(bw, strategy.mesh), plan)


def shared_links(bw, mesh) -> dict:
    """{level: owner} for the levels whose traffic goes through another level's links
    ([Note: shared links] in network.py, [Note: one in-node link] in timing.py)."""
    return {l: bw.key(mesh, l) for l in mesh.names if bw.key(mesh, l) != l}


def to_json(e: Explained) -> dict:
    """The `explain --json` document (bytes per rank; link bytes per rank per step)."""
    s = e.strategy
    return {
        "strategy": s.name,
        "mesh": [{"name": l.name, "size": l.size} for l in s.mesh.levels],
        "micro_batches": e.micro_batches,
        "params": model_params(e.units)[0],
        "expert_params": model_params(e.units)[1].get(Over.EXPERTS, 0),
        "units": len(e.units),
        "memory": dict(e.memory),
        "ledger": ledger_dicts(e.ledger),
        "collectives": e.algo.value,
        "links": {k: round(v) for k, v in e.links.items()},
        "inter": round(e.inter),
        "intra": round(e.intra),
        "shared_links": dict(e.shared or {}),
        "time": None if e.time is None else {
            "compute": e.time.compute, "total": e.time.total,
            "comm": dict(e.time.comm), "exposed": e.time.exposed},
        "peak": e.peak,
        "rates": e.rates,
        "owners": _owners(e),
    }


def _owners(e: Explained) -> list[dict]:
    """The tensor owners of an `optim ... by tensor` scope ([] when none), costmodel/owned.py."""
    if e.plan is None or not e.plan.owned.groups:
        return []
    from shardc.analysis.costmodel.owned import owners_doc
    return owners_doc(e.plan.owned)
