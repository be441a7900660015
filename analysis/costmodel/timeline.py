"""The memory timeline per rank — when each buffer of the peak is alive, phase by phase.

Input: the lowered plan (`shardc.lowering.Lowering`: its units' groups, their factors and
the forward schedule), `memory_of`'s model states and gathered window (memory.py) and one
micro-batch's activations (activations.py). Output: a `Timeline`, one `Point` per phase
(start-up, forward, backward, sync, step) with the named buffers alive at that phase's
peak; its maximum is explain's peak (the framework overhead is added apart, a named
constant: activations.py [Note: framework overhead]).

This file walks the step (the phases' points and the lifetimes between them); the bytes each
unit's buffers hold are unit_buffers.py's (`UnitBuffers`: gathered, autograd's gradient,
reduce workspace, collective staging, syncs, update gathers), the loss's tensors loss.py's.

Each buffer kind has a [Note] (here, or in unit_buffers.py and loss.py where its size is
the point) naming the runtime site that allocates and frees it; the
bounds the runtime obeys are read from the lowering (lowering/transients.py:
REDUCE_IN_FLIGHT, RELEASE_GRADS, SYNC_IN_FLIGHT, STAGING_BYTES; lowering/peak_facts.py:
CODEC_ROWS), never restated here. The model states (params, hpZ secondary, optimizer
states and master) are alive in every phase after start-up and are one buffer, "states";
the grad shards join them as [Note: timeline: grad shards] says.

[Note: timeline: grad shards]
shardc.lowering [Note: gradient lifetimes] (RELEASE_GRADS): zero_grad() frees every grad
shard, so the forward of a step's first micro-batch holds none ("states" there is
memory_report()'s total less its `grads`). In the backward a unit's shard appears when its
gradients arrive (s_G = 1: after its backward ran, so not beside its saved tensors while
it runs) or when its reduce-scatter is issued (s_G > 1: the reduce-scatter writes into the
shard itself, with no chunk beside it, runtime/groups/storage.py [Note: reduce into the
shard]; a later micro-batch's lands in a workspace chunk); a group with no gradient's at the sync. From
the sync to zero_grad() every shard is alive (the sync and step points count the whole
total). With more than one micro-batch the later forwards and backwards hold every shard.
The fp32 copies a bf16 grad shard is read through (runtime/state/params.py [Note:
gradients]: N/s_OS x 4 bytes per group, made when the step's sync completes, freed by
zero_grad()) count at the step's points after that completion: the optimizer's
temporaries and the update gathers ([Note: timeline: fp32 gradients]).

[Note: timeline: fp32 gradients]
Where a group's grads are not fp32, opt.step() (its first read of a gradient, `settle`)
waits the step's sync and copies each parameter's OS slice of the grad shard into an fp32
gradient: every trainable group's at once, alive until zero_grad() (shardc.lowering [Note:
gradient lifetimes]). They are beside the states and the optimizer's temporaries and the
update gathers, not beside the syncs in flight (waited first). Measured: MiCS in bf16 on
LLaMA-65B at 1024 ranks, 32.65 GB of them (4 x 65.3 B / 8) in a 147.4 GB step.

[Note: timeline: gathered window]
runtime/groups/flat_group.py `issue_gather` allocates a unit's full buffer (runtime/groups/storage.py
`FlatStorage`), `release` frees it after the unit ran (the root stays gathered). Forward
and backward walk the same window (memory.py [Note: transient window]).

[Note: timeline: forward's end]
runtime/eager/engine.py `finish_forward` releases a non-root unit as soon as its last module
ran, the last unit too: the logits and the loss's log-softmax are made beside the root's
buffer only (and the backward's first stage gathers the last unit again, [Note: timeline:
loss gradient]). So the forward has a point as each unit has run, before its release: its window (itself,
the root and the gathers issued ahead, their first stage buffers too) beside the
activations made so far, its own included (the root's counted from the start: a bound by
its head's saved tensors); the last unit's with every activation; and one at the end: the
root alone with every activation and the loss's tensors. Counting the last unit's window
beside the loss's tensors was over by one unit's parameters: MiCS on HF Llama at 8 ranks,
explain's forward 1.047 of the measured one (5,893,856 B against 5,631,204); leaving out
the point as a unit has run was under: MiCS on examples/gpt.py `small` at 4 ranks, the
forward's peak as block 2 has run with block 3 gathered ahead (0.945).

[Note: timeline: activations]
At the end of the forward (with its loss) one micro-batch's saved tensors are all alive
(activations.py [Note: activation peak]); the backward frees them unit by unit (the
trace's per-unit `saved`). Each unit has its points: while its backward runs (and at its
gather's wait), its own saved tensors still count beside its gradient and the previous
unit's reduce in flight (an upper bound: autograd frees them as the unit's backward runs);
once its reduce is issued they are gone (its gradient, its reduce and that reduce's
staging counted instead). Measured (HF GPT-2 at 4 ranks, after peak-runtime): ddp peaks at
the first point, zero3 at its gather's wait, zeropp at the issue (its qgZ codec). Under checkpointing all of them stay counted.

[Note: timeline: loss gradient]
The backward starts at the loss: cross entropy's backward makes its gradients (loss.py
[Note: timeline: loss tensors] has the rule, by the logits' dtype) while only the root is
gathered: the backward's first stage (the last unit's re-gather and the gathers ahead) is
issued by the multi-grad hook on the last unit's outputs (runtime/eager/engine.py [Note:
schedule]), after the head's backward. Measured with bench/peak_probe.py on a 2-block Llama
in bf16 (zero3, 4 ranks): the backward's peak at the loss is the root's buffer, not the
two blocks' beside it (164,260 B over with them, 2 x 82,176); LLaMA-7B zero3 at 64 GPUs
was 1.019 of the measured peak with them. From the head's backward on, the head's gradients
stay (`kept`) until the root's own points, which count them in its autograd gradient. The
point while a unit's backward runs leaves them out: it counts the unit's saved tensors and
its gradient whole, where autograd frees the one as it makes the other, a bound by more than
the head's gradients (with them: examples/gpt.py `small` zero3 at 2 gloo ranks 1.033 of the
measured backward; LLaMA-7B zero3 at 64 GPUs 1.017, without 1.000).

[Note: timeline: reduce workspace]
runtime/groups/workspace.py [Note: reduce workspace], shardc.lowering [Note: reductions in
flight] (REDUCE_IN_FLIGHT = 1): with s_G > 1 a unit's reduce-scatter holds its flat input
(N) and, after the step's first micro-batch, its output chunk (N/s_G; in the first the
output is the grad shard itself) until the next unit's gradients arrive; that wait comes
before the next copy, and the unit's gathered buffer is freed before it too, so the next
unit's flat input reuses the same workspace. The pool keeps what was handed back, so from
a unit's copy on it holds the largest (N + N/s_G) so far (its high-water mark) and, on the
gloo all-to-all path, the receive blocks it lent that unit's reduce-scatter (`a2a`;
staging.py [Note: staging: receive blocks]; none where the reduce-scatter is native: a
device backend, a simulated rank). Measured on 4 gloo ranks (bench/peak_gloo.py): PaRO-IIG
on HF GPT-2 (4 micro-batches) 0.937 of the backward's peak with the blocks in the staging
only, where the pool does not keep them. With more than one micro-batch the pool keeps it between micro-batches, so
every later forward and backward holds the largest unit's worth from its start.

[Note: timeline: start-up]
memory.py [Note: start-up peak]: the shards plus the largest unit's whole parameters.

[Note: timeline: update gathers]
After the optimizer's step every group with an update all-gather (OS∖P) issues it at once
(runtime/eager/step_ops.py `update`, runtime/groups/flat_group.py `update_issue`): each holds a clone of its OS
chunk in the params dtype and its gather's first-stage buffer (staging.py) until waited
(then, or, for the units the `defer_update` pass lists, before each is next needed in the
next forward); the one waited holds its last stages. The deferred ones are owed in the
step's first forward only, which holds no grad shard (zero_grad() freed them); a later
micro-batch's forward holds every shard and owes none, so a forward point is the larger
of the two, not both (ZeRO-topo, 4 micro-batches, HF Llama at 8 gloo ranks: both counted
put explain's forward at 1.033 of the measured one).

[Note: timeline: optimizer step]
opt.step() (runtime/step/optimizer.py) runs the optimizer over every group's OS chunk,
holding the optimizer's own temporaries for the optimizer the user gives,
shardc.lowering.optimizers `step_temporary_bytes` ([Note: step temporaries]: AdamW foreach
1x the stepped bytes, fused none, the per-tensor loop 2x the piece it steps and 1x the one
before it; SGD none without weight decay), for the implementation torch runs on the job's
device (`device`: explain's `--backend gloo` is a CPU job, torch's per-tensor loop, and so
are a simulated rank's meta tensors; else a GPU, foreach), with the largest chunk as
foreach's stepped bytes (a bound) and, for the loop, each rank's pieces in the order it
steps them (step_pieces.py [Note: a rank's pieces in step order]). The update all-gathers'
clones of their OS chunks (runtime/groups/flat_group.py `update_issue`, `mine.clone()`)
are made after opt.step() returns (its post-hook, runtime/step/boundary.py
`optimizer_stepped`), when the temporaries are gone: they are the update gathers' point
([Note: timeline: update gathers]), not this one. Measured: on 4 gloo ranks (HF GPT-2,
MiCS) the foreach rule with a clone put explain's step at 1.035x the measured one, the
loop's rule within 0.1 %; HF Llama under zero3 at 8 gloo ranks, 0.970 with 2x the largest
piece, 1.000 with the pieces in step order (the embedding's piece, then the first block's
q_proj's: 1x + 2x); a 3-level bf16 strategy with overrides under `shardc simulate`
(tests/test_peak_bf16_overrides.py), 1.037 with the clone beside the temporaries.

[Note: timeline: step-end sync]
An early sync with an all-reduce stage is advanced (its chunk copied into the OS slice and
freed) right after the next unit's is issued, so at that issue two syncs are in their
reduce-scatter stage (a point of its own: measured on lins_7b, HF Llama at 4 ranks, two
chunks from `sync_issue` beside the root's gradient; explain 1.065 x measured before).
The backward that ends the step issues every unit's sync (runtime/groups/flat_group.py `sync_issue`):
a unit the `early_sync` pass lists right after its own reduce is waited (runtime/eager/engine.py
`_bound_reductions`: as the next unit's gradients arrive), the others at the backward's end, at most SYNC_IN_FLIGHT groups at
a time (shardc.lowering [Note: syncs in flight], runtime/eager/step_ops.py). A sync in its
reduce-scatter stage holds its output chunk (N/s_OS) and the reduce-scatter's staging;
an early sync is advanced when the next unit's is issued (runtime/step/boundary.py `sync_early`): its
chunk is copied into the OS slice and its all-reduce over the replicas goes out, holding
that all-reduce's staging until opt.step() waits it; a sync with no all-reduce stays in
its reduce-scatter stage until then. A sync with no reduce-scatter stage issues its
all-reduce at once. So at the backward's end ("sync") and at the start of opt.step()
("step") the early syncs' buffers and the bounded ones are alive, and the reduce workspace
is still held at the backward's end (the loss's tensors are not: the head's gradients went
with the root's reduce, loss.py). The simulated step measures "sync" inside its backward phase (`MEASURED`).

"""
from __future__ import annotations

from dataclasses import dataclass

from shardc.lowering import REDUCE_IN_FLIGHT, RELEASE_GRADS, SYNC_IN_FLIGHT, Lowering, Phase
from shardc.lowering.optimizers import DEFAULT_OPTIMIZER

from .loss import loss_tensors
from .step_pieces import step_bytes
from .unit_buffers import UnitBuffers, grad_full

# The backward walk in `timeline` keeps one earlier unit's reduce-scatter in flight (`prev`):
# the runtime's bound REDUCE_IN_FLIGHT (runtime/eager/engine.py `_bound_reductions`) read here,
# so a larger bound fails at import instead of mispredicting the peak.
if REDUCE_IN_FLIGHT != 1:
    raise ImportError(f"timeline models one reduce-scatter in flight, the runtime allows {REDUCE_IN_FLIGHT}")

PHASES = ("startup", "forward", "backward", "sync", "step")
# The timeline's points each phase of `shardc simulate`'s measured step spans: the sync is
# issued inside the backward that ends the step.
MEASURED = {"forward": ("forward",), "backward": ("backward", "sync"), "step": ("step",)}


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

    def measured_phase(self, name: str) -> int:
        """explain's bytes for a phase of the simulated step (`MEASURED`)."""
        return max(self.phase(p).bytes for p in MEASURED[name])

    def to_json(self) -> list[dict]:
        return [{"phase": p.phase, "bytes": p.bytes, "buffers": dict(p.buffers)} for p in self.points]


def timeline(plan: Lowering, memory: dict, activations: int, saved: tuple | None = None,
             output: int = 0, micro_batches: int = 1, mesh=None, algo=None,
             optimizer: str = DEFAULT_OPTIMIZER, optimizer_kwargs: dict | None = None,
             a2a: bool = False, logits: int = 0, head: int = 0, device: str = "cuda") -> Timeline:
    """The phases' peaks of one step ([Note]s above), from the plan and the states.
    `saved`: each unit's saved activation bytes (the trace's, unit order; None or under
    checkpointing: `activations` stays alive through the whole backward). `mesh`, `algo`:
    the strategy's mesh and its resolved collective algorithm, for the collectives' own
    buffers (None: not counted). `optimizer`, `optimizer_kwargs`: the step's optimizer, for its
    temporaries ([Note: timeline: optimizer step]). `a2a`: the backend reduce-scatters by
    all-to-all (gloo), so its receive blocks count (staging.py [Note: staging: receive blocks]).
    `output`, `logits`, `head`: the trace's fp32 logits, its logits in their own dtype and the
    head's parameter elements, for the loss's tensors (loss.py). `device`: where the tensors
    are, for the optimizer's implementation ([Note: timeline: optimizer step])."""
    units = plan.units
    z = UnitBuffers(plan, mesh, algo, a2a)
    size = z.gathered
    root_e = max((grad_full(units[0], g) // max(g.n, 1) for g in units[0].groups if g.trainable), default=0)
    loss = loss_tensors(output, logits, head * root_e)
    grads = int(memory["grads"])
    # the model states without the grad shards: zero_grad() freed them ([Note: timeline: grad shards])
    bare = int(memory["total"]) - (grads if RELEASE_GRADS else 0)
    states = int(memory["total"])
    # the pool kept between micro-batches ([Note: timeline: reduce workspace]): one unit's
    # flat input and output chunk, the largest, and one receive block
    pool = max((r + b for r, b in zip(z.reduce, z.recv)), default=0) if micro_batches > 1 else 0
    # a forward after the first micro-batch's backward holds every grad shard
    fwd_states = states if micro_batches > 1 or not RELEASE_GRADS else bare
    # forward: the window as each unit runs, each unit's gather waited beside what ran before
    # it; the activations peak at the forward's end
    left = list(saved) if saved is not None and len(saved) == len(units) else None
    held: set[int] = set()
    made = 0
    waits: list[Point] = []
    deferred = set(plan.schedule.update_deferred)
    owed = {k: a for k, a, _ in z.update if k in deferred}     # waited where each unit is next needed
    last = 0

    def owing(o: int) -> tuple:
        """The states and the update gathers owed ([Note: timeline: update gathers]): owed in
        the first micro-batch's forward only, which holds no grad shard; a later one holds
        every shard and owes nothing."""
        first = (("states", bare if RELEASE_GRADS else states), ("update gathers owed", o))
        later = (("states", states), ("update gathers owed", 0))
        return max(first, later, key=lambda b: b[0][1] + b[1][1]) if micro_batches > 1 else first
    for st in plan.schedule.forward:
        held |= {st.unit, *st.issue} if size[st.unit] else set(st.issue)
        last = sum(size[i] for i in held)
        if size[st.unit] and mesh is not None:
            waits.append(Point("forward", (*owing(sum(owed.values())), ("gathered", last),
                                           ("activations so far", made),
                                           (f"gather staging of {units[st.unit].name}",
                                            z.ag_wait[Phase.FORWARD][st.unit]),
                                           ("gathers issued ahead", sum(z.ag_issued[Phase.FORWARD][k]
                                                                        for k in st.issue if k != st.unit)),
                                           ("reduce workspace pool", pool))))
        owed.pop(st.unit, None)
        if left is not None:
            made += left[st.unit]
            # it ran: its saved tensors made beside its window and the gathers issued ahead
            # ([Note: timeline: forward's end]), before its release
            waits.append(Point("forward", (*owing(sum(owed.values())),
                                           (f"gathered as {units[st.unit].name} ran", last),
                                           ("activations so far", made),
                                           ("gathers issued ahead", sum(z.ag_issued[Phase.FORWARD][k]
                                                                        for k in st.issue if k != st.unit)),
                                           ("reduce workspace pool", pool))))
        if st.unit != 0:
            held.discard(st.unit)
    # the last unit ran inside its window and was released ([Note: timeline: forward's end]),
    # so the logits and the loss are made beside the root alone
    end = sum(size[i] for i in held)
    fwd = Point("forward", (("states", fwd_states), ("gathered at the forward's end", end),
                            ("activations", activations), ("logits and loss", loss.forward),
                            ("reduce workspace pool", pool)))
    ran = Point("forward", (("states", fwd_states), ("gathered as the last unit ran", last),
                            ("activations", activations), ("reduce workspace pool", pool)))
    fwd = max([fwd, ran, *waits], key=lambda p: p.bytes)
    # backward: each unit's gradient made, its reduce issued once the previous unit's is waited
    alive = activations
    # at the loss the root alone is gathered: the backward's first stage is issued by the
    # multi-grad hook on the last unit's outputs, after the head's backward ([Note: timeline:
    # loss gradient])
    bwd = Point("backward", (("states", fwd_states), ("gathered at the loss", end),
                             ("activations", activations), ("loss gradients", loss.at_loss),
                             ("reduce workspace pool", pool)))
    stages = {st.unit: st for st in plan.schedule.backward}
    early = set(plan.schedule.sync_early)
    # grad shards alive: every one after the first micro-batch, else none yet
    shards = grads if fwd_states == states else 0
    ws = pool                                   # the reduce workspace's high-water mark
    prev: int | None = None                     # the unit whose reduce-scatter is in flight
    synced: list[int] = []
    order = [i for i in range(len(units) - 1, 0, -1)] + [0]
    for i in order:
        # the head's gradients until the root's own points count them in its gradient
        kept = ("the head's gradients", loss.kept if i != 0 else 0)
        lg = ("the logits' gradient", loss.last_unit if i == order[0] != 0 else 0)
        st = stages.get(i)
        issue = set(st.issue) if st is not None else set()
        held |= issue | ({i} if size[i] and st is not None else set())
        ahead = sum(z.ag_issued[Phase.BACKWARD][k] for k in issue if k != i)
        early_bytes = sum(z.synced_early(k, n + 1 < len(synced)) for n, k in enumerate(synced))
        in_flight = z.rs_staging[prev] + z.kept_grad[prev] if prev is not None else 0
        gathered = sum(size[k] for k in held)
        # while its backward runs: its saved tensors and its gradient, the previous reduce in flight
        pts = [Point("backward", (("states", bare), ("grad shards", shards), ("gathered", gathered),
                                  ("activations left", alive), lg,
                                  (f"autograd's gradient of {units[i].name}", z.grad[i]),
                                  ("reduce workspace", ws), ("reduce-scatter staging", in_flight),
                                  ("gathers issued ahead", ahead), ("early syncs", early_bytes)))]
        if st is not None and size[i]:
            pts.append(Point("backward", (("states", bare), ("grad shards", shards), ("gathered", gathered),
                                          ("activations left", alive), kept, lg,
                                          ("reduce workspace", ws), ("reduce-scatter staging", in_flight),
                                          (f"gather staging of {units[i].name}", z.ag_wait[Phase.BACKWARD][i]),
                                          ("gathers issued ahead", ahead), ("early syncs", early_bytes))))
        # its gradients copied: its gathered buffer freed first, the previous reduce waited
        if i != 0:
            held.discard(i)
        gathered = sum(size[k] for k in held)
        if shards != grads:
            shards += z.shard_on_arrival[i]     # s_G = 1: the shard exists from its gradients' arrival
        if prev is not None:
            if prev in early:
                synced.append(prev)         # its reduce waited: its sync goes out
        if prev is not None and prev in early:
            # the previous unit's sync issued while the one before it is still in its
            # reduce-scatter stage (runtime/step/boundary.py `sync_early` advances it right after)
            issuing = sum(z.synced_early(k, n + 2 < len(synced)) for n, k in enumerate(synced))
            pts.append(Point("backward", (("states", bare), ("grad shards", shards), ("gathered", gathered),
                                          ("activations left", alive - (left[i] if left is not None else 0)), kept, lg,
                                          (f"autograd's gradient of {units[i].name}", z.grad[i]),
                                          ("reduce workspace", ws), ("reduce-scatter staging", in_flight),
                                          ("gathers issued ahead", ahead), ("early syncs", issuing))))
        early_bytes = sum(z.synced_early(k, n + 1 < len(synced)) for n, k in enumerate(synced))
        if shards != grads:
            shards += z.shard_on_wait[i]        # s_G > 1: its reduce-scatter lands in the shard itself
        if z.reduce[i]:                         # ... so no chunk in the step's first micro-batch
            ws = max(ws, z.reduce[i] - (z.shard_on_wait[i] if micro_batches == 1 else 0) + z.recv[i])
        done = alive - (left[i] if left is not None else 0)
        # its gradients copied and its reduce issued (autograd's gradient freed only when its
        # views' backward returns, after the issue): the reduce-scatter's staging and codec
        pts.append(Point("backward", (("states", bare), ("grad shards", shards), ("gathered", gathered),
                                      ("activations left", done), kept, lg,
                                      (f"autograd's gradient of {units[i].name}", z.grad[i]),
                                      ("reduce workspace", ws),
                                      ("reduce-scatter staging", z.rs_staging[i]), ("reduce codec", z.rs_codec[i]),
                                      ("gathers issued ahead", ahead), ("early syncs", early_bytes))))
        bwd = max([bwd, *pts], key=lambda p: p.bytes)
        alive = done                        # its saved tensors are gone once its backward ran
        prev = i                            # waited (its reduce, its early sync's turn) as the next gradients arrive
    # the last unit reduced is waited by no later unit: its sync goes out with the bounded
    # ones at the backward's end (runtime/step/boundary.py `_issue_sync`), which advances no
    # early sync, so the last early one stays in its reduce-scatter stage until opt.step()
    rest = sorted((z.sync[k] + z.sync_ar[k] for k in range(len(units)) if k not in synced), reverse=True)
    early_bytes = sum(z.synced_early(k, n + 1 < len(synced)) for n, k in enumerate(synced))
    sync_buffers = (("early syncs", early_bytes), ("syncs in flight", sum(rest[:SYNC_IN_FLIGHT])))
    chunk = max((g.optim_elems * 4 for u in units for g in u.groups if g.trainable), default=0)
    fp32_grads = ("fp32 gradients", sum(g.optim_elems * 4 for u in units for g in u.groups
                                        if g.trainable and grad_full(u, g) != 4 * g.n))
    pts = [
        Point("startup", (("shards and the largest unit's whole parameters", int(memory["startup"])),)),
        fwd, bwd,
        Point("sync", (("states", states), ("reduce workspace", ws), *sync_buffers)),
        max(Point("step", (("states", states), *sync_buffers)),
            Point("step", (("states", states), fp32_grads,
                           ("optimizer step temporaries",
                            step_bytes(plan, optimizer, optimizer_kwargs, chunk, device)))),
            Point("step", (("states", states), fp32_grads, ("update gathers in flight", sum(a for _, a, _ in z.update)),
                           ("update gather staging at its wait",
                            max((b for k, _, b in z.update if k not in deferred), default=0)))),
            key=lambda p: p.bytes),
    ]
    return Timeline(tuple(pts))
