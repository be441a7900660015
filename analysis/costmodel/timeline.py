"""The memory timeline per rank — every buffer-lifetime rule of the peak, in one place.

Input: the lowered plan (`shardc.lowering.Lowering`: its units' groups, their factors and
the forward schedule), `memory_of`'s model states and gathered window (memory.py) and one
micro-batch's activations (activations.py). Output: a `Timeline`, one `Point` per phase
(start-up, forward, backward, sync, step) with the named buffers alive at that phase's
peak; its maximum is explain's peak (the framework overhead is added apart, a named
constant: activations.py [Note: framework overhead]).

Each buffer kind has a [Note] naming the runtime site that allocates and frees it. The
model states (params, hpZ secondary, grad shard, optimizer states and master) are alive in
every phase after start-up and are one buffer, "states".

[Note: timeline: gathered window]
runtime/flat_group.py `issue_gather` allocates a unit's full buffer (storage.py
`FlatStorage`), `release` frees it after the unit ran (the root stays gathered). Forward
and backward walk the same window (memory.py [Note: transient window]).

[Note: timeline: activations]
At the end of the forward (with its loss) one micro-batch's saved tensors are all alive
(activations.py [Note: activation peak]); the backward frees them unit by unit (the
trace's per-unit `saved`). A unit's own saved tensors count while its gradient is made
and its reduce issued (an upper bound: autograd frees them as the unit's backward runs);
they are gone for the next unit. Under checkpointing all of them stay counted.

[Note: timeline: loss gradient]
The backward starts at the loss: cross entropy on the fp32 logits (shardc/simulate.py's
step) makes gradients the logits' size (the trace's `output`) while the root's head runs
its backward, beside every activation and the units gathered at the forward's end.
`LOSS_GRADIENTS` of them is measured, not derived: on GPT tiny at 4 ranks (ddp) the
backward's peak is 65,544 bytes above states + activations, 4 x the 16,384-byte logits.

[Note: timeline: autograd gradient]
In the backward autograd makes the unit's gradients, full size N in the grad dtype, before
the unit's hook lays them out flat (runtime/flat_group.py `reduce_slot_grads`); they are
freed once `reduce_grad` has copied them (s_G > 1) or added them in (s_G = 1).

[Note: timeline: reduce workspace]
runtime/workspace.py [Note: reduce workspace]: with s_G > 1 a unit's reduce-scatter holds
its flat input (N) and its output chunk (N/s_G) until it is waited; the engine keeps one
unit's in flight while the next is issued, so two units' worth are alive at the
backward's peak (`REDUCES_IN_FLIGHT`). With more than one micro-batch the pool keeps
them between micro-batches (emptied only at the backward that issues the step's sync), so
every later forward and backward holds the two largest units' worth from its start.
Measured: the planner's zero2-like pick with `accumulate 4` on GPT tiny at 4 ranks peaks
at the loss at states + activations + loss gradients + this pool (to 8 bytes).

[Note: timeline: sync chunk]
runtime/flat_group.py `sync_issue`: where the step-end sync has a reduce-scatter stage
(OS∖G), every unit's sync is issued at the end of the backward and each holds its output
chunk (N/s_OS, grad dtype) until `sync_advance` copies it into the OS slice.

[Note: timeline: start-up]
memory.py [Note: start-up peak]: the shards plus the largest unit's whole parameters.

[Note: timeline: optimizer step]
In opt.step() (runtime/optimizer.py) the optimizer runs over one group's OS chunk at a time
and the update all-gather sends a copy of it (flat_group.py `update_issue`, `mine.clone()`):
`STEP_TEMPORARIES` fp32 copies of the largest chunk. Measured with the step phase of
`shardc simulate` (AdamW, foreach): 2.0x the largest chunk for zero3, 0.67x for ddp, on
GPT tiny and small at 4 ranks, so the rule is a bound; foreach against fused is not yet
measured apart.
"""
from __future__ import annotations

from dataclasses import dataclass

from shardc.lowering import Lowering, Op, Phase

# One owner: the engine keeps one unit's reduce-scatter in flight while the next is issued
# (runtime/engine.py, runtime/workspace.py [Note: reduce workspace]).
REDUCES_IN_FLIGHT = 2
# Gradients the loss's backward makes, each the size of the fp32 logits ([Note: timeline: loss gradient]).
LOSS_GRADIENTS = 4
# fp32 temporaries of the largest group's optimizer chunk in the step ([Note: timeline: optimizer step]).
STEP_TEMPORARIES = 2

PHASES = ("startup", "forward", "backward", "sync", "step")


@dataclass(frozen=True, slots=True)
class Point:
    """One phase's peak: the buffers alive then, bytes per rank."""
    phase: str
    buffers: tuple[tuple[str, int], ...]

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.buffers)


@dataclass(frozen=True, slots=True)
class Timeline:
    points: tuple[Point, ...]

    @property
    def peak(self) -> Point:
        return max(self.points, key=lambda p: p.bytes)

    def phase(self, name: str) -> Point:
        return next(p for p in self.points if p.phase == name)

    def to_json(self) -> list[dict]:
        return [{"phase": p.phase, "bytes": p.bytes, "buffers": dict(p.buffers)} for p in self.points]


def _grad_full(u, g) -> int:
    """A group's whole local gradient, grad dtype (its shard times s_G)."""
    return g.grads_bytes * u.factors_of(g).g if g.trainable else 0


def timeline(plan: Lowering, memory: dict, activations: int, saved: tuple | None = None,
             output: int = 0, micro_batches: int = 1) -> Timeline:
    """The phases' peaks of one step ([Note]s above), from the plan and the states.
    `saved`: each unit's saved activation bytes (the trace's, unit order; None or under
    checkpointing: `activations` stays alive through the whole backward)."""
    states = int(memory["total"])
    units = plan.units
    size = [sum(g.gathered_bytes for g in u.groups) for u in units]
    grad = [sum(_grad_full(u, g) for g in u.groups) for u in units]
    reduce = [sum(_grad_full(u, g) + g.grads_bytes for g in u.groups
                  if g.trainable and u.factors_of(g).g > 1) for u in units]
    # the pool kept between micro-batches ([Note: timeline: reduce workspace])
    pool = sum(sorted(reduce, reverse=True)[:REDUCES_IN_FLIGHT]) if micro_batches > 1 else 0
    # forward: the window as each unit runs; the activations peak at the forward's end
    held: set[int] = set()
    for st in plan.schedule.forward:
        held |= {st.unit, *st.issue} if size[st.unit] else set(st.issue)
        last = sum(size[i] for i in held)
        if st.unit != 0:
            held.discard(st.unit)
    fwd = Point("forward", (("states", states), ("gathered at the forward's end", last),
                            ("activations", activations), ("reduce workspace pool", pool)))
    # backward: each unit's gradient made, its reduce issued beside the previous unit's
    left = list(saved) if saved is not None and len(saved) == len(units) else None
    alive = activations
    bwd = Point("backward", (("states", states), ("gathered at the forward's end", last),
                             ("activations", activations), ("loss gradients", LOSS_GRADIENTS * output),
                             ("reduce workspace pool", pool)))
    flight = []
    for st in plan.schedule.backward:
        held |= {st.unit, *st.issue} if size[st.unit] else set(st.issue)
        flight = (flight + [reduce[st.unit]])[-REDUCES_IN_FLIGHT:]
        pt = Point("backward", (("states", states), ("gathered", sum(size[i] for i in held)),
                                ("activations left", alive), (f"autograd's gradient of {units[st.unit].name}",
                                                              grad[st.unit]),
                                ("reduce workspace", max(sum(flight), pool))))
        bwd = pt if pt.bytes > bwd.bytes else bwd
        if left is not None:                # its saved tensors are gone once its backward ran
            alive -= left[st.unit]
        if st.unit != 0:
            held.discard(st.unit)
    sync = sum(g.optim_elems * (g.grads_bytes * u.factors_of(g).g // max(g.n, 1))
               for u in units for g in u.groups if g.trainable and g.row(Phase.SYNC, Op.REDUCE_SCATTER) is not None)
    chunk = max((g.optim_elems * 4 for u in units for g in u.groups if g.trainable), default=0)
    pts = [
        Point("startup", (("shards and the largest unit's whole parameters", int(memory["startup"])),)),
        fwd, bwd,
        Point("sync", (("states", states), ("sync chunks", sync))),
        Point("step", (("states", states), ("optimizer step temporaries", STEP_TEMPORARIES * chunk))),
    ]
    return Timeline(tuple(pts))
