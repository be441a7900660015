"""Predicted memory per rank — what `ShardedModule.memory_report()` will measure.

Input: a Strategy's mesh, the model's `UnitSize`s, the optimizer class name and its
kwargs. Output: `{"params", "params_secondary", "grads", "optim", "total",
"transient", "startup"}` in bytes per rank (docs/internals.md, "Memory"). `total` is the
sum of the four persistent states, as the runtime reports it; `transient` is extra;
`startup` is the start-up peak, the plan's fact `startup_bytes` (lowering/startup.py,
[Note: start-up peak]: the shards plus the largest staging of the value sources: init,
scatter, a load).

[Note: transient window]
The root unit stays gathered through forward and backward; every other unit is held
gathered from the moment its all-gather is issued until it is released. `transient`
walks the plan's forward `Schedule`: before each unit runs its stage's gathers are
issued; the peak of the full sizes (params dtype, padded, units with s_P > 1) held at
once is the figure. With `prefetch k` that is the root plus k+1 consecutive gathered
units. It is an estimate the runtime does not report.
"""
from __future__ import annotations

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Mesh
from shardc.lowering import Lowering, lower
from shardc.lowering.optimizers import DEFAULT_OPTIMIZER, OPTIMIZER_KINDS, optimizer_kind
from shardc.lowering.startup import startup_bytes

# The classes K_state is known for, as the command line spells them.
OPTIMIZERS = tuple(k.name.lower() for k in OPTIMIZER_KINDS.values() if k.state_bytes is not None and k.elementwise)


def optimizer_state_bytes(optimizer: str = DEFAULT_OPTIMIZER, **kw) -> int:
    """K_state: bytes of optimizer state per element (fp32 moments), by class name
    (`shardc.lowering.optimizers`, [Note: K_state])."""
    kind = optimizer_kind(optimizer)
    k_state = None if kind is None else kind.k_state(**kw)
    if k_state is None:
        raise ShardcError(f"unknown optimizer {optimizer!r}; the cost model knows {', '.join(OPTIMIZERS)}")
    return k_state


def memory_of(plan: Lowering, *, k_state: int, prefetch: int = 1) -> dict[str, int]:
    """Bytes per rank of each model state: sums of the plan's per-group storage."""
    groups = [g for u in plan.units for g in u.groups]
    mem = dict(params=sum(g.params_bytes for g in groups),
               params_secondary=sum(g.secondary_bytes for g in groups),
               grads=sum(g.grads_bytes for g in groups),
               optim=sum(g.optim_elems * k_state + g.master_bytes for g in groups))
    mem["total"] = sum(mem.values())
    mem["transient"] = transient_bytes(plan, prefetch)
    mem["startup"] = startup_bytes(plan)
    return mem


def predict_memory(mesh: Mesh, units, *, optimizer: str = DEFAULT_OPTIMIZER,
                   optimizer_kwargs: dict | None = None, prefetch: int = 1) -> dict[str, int]:
    """Bytes per rank of each model state, as `memory_report()` measures it."""
    k_state = optimizer_state_bytes(optimizer, **(optimizer_kwargs or {}))
    plan = lower(mesh, units, prefetch)
    return memory_of(plan, k_state=k_state, prefetch=prefetch)


def transient_bytes(plan: Lowering, prefetch: int = 1) -> int:
    """Peak bytes of gathered (full) unit params held at once while the plan's forward
    schedule runs; see [Note: transient window]."""
    size = [sum(g.gathered_bytes for g in u.groups) for u in plan.units]
    held: set[int] = set()
    peak = 0
    for stage in plan.schedule.forward:
        held |= {stage.unit, *stage.issue} if size[stage.unit] else set(stage.issue)
        peak = max(peak, sum(size[i] for i in held))
        if stage.unit != 0:
            held.discard(stage.unit)       # released after it ran; the root stays gathered
    return peak
