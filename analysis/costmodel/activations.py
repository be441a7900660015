"""Peak memory per rank — model states, gathered units, activations and overhead.

Input: `predict_memory`'s figures (model states and the transient window of gathered
units) and a `GraphCost` (saved bytes per unit for one micro-batch, from `flops.trace`).
Output: `{"states", "gathered", "activations", "overhead", "peak", "dominant"}` in
bytes per rank; the planner's memory limit applies to "peak". Without a traced graph
"activations", "peak" and "dominant" are None: there is no peak without activations.

[Note: activation peak]
Micro-batches run one after the other, so one micro-batch's activations are live at
a time; the peak is at the start of its backward.
- Without checkpointing every unit keeps what autograd saved: Σ saved_i.
- With activation checkpointing (`--checkpoint`: every non-root unit recomputes its
  forward in the backward) a unit keeps only its input until its backward; the root
  keeps its saved tensors, and one unit's full saved set is rebuilt at a time:
  saved_root + Σ_{i≥1} input_i + max_{i≥1} saved_i.
Activations do not depend on the sharding strategy (data parallelism splits the batch,
not the micro-batch), so the planner traces the model once.

[Note: framework overhead]
FRAMEWORK_OVERHEAD is a stated constant, not a measurement: the CUDA context,
communication buffers and the caching allocator's fragmentation, which every rank
pays whatever the strategy. 2 GiB is what an idle PyTorch + NCCL process holds on
an A100 in our experience; `--overhead` replaces it for one run.
"""
from __future__ import annotations

from shardc.lowering.optimizers import DEFAULT_OPTIMIZER

from .timeline import timeline

FRAMEWORK_OVERHEAD = 2 * 2**30


def activation_bytes(graph, checkpoint: bool = False) -> int:
    """Peak activation bytes of one micro-batch ([Note: activation peak])."""
    if not checkpoint or len(graph.saved) < 2:
        return int(sum(graph.saved))
    return int(graph.saved[0] + sum(graph.inputs[1:]) + max(graph.saved[1:]))


def peak_memory(memory: dict, graph=None, checkpoint: bool = False, overhead: int = FRAMEWORK_OVERHEAD,
                plan=None, micro_batches: int = 1, mesh=None, algo=None, optimizer: str = DEFAULT_OPTIMIZER,
                optimizer_kwargs: dict | None = None, a2a: bool = False, device: str = "cuda") -> dict:
    """The peak per rank and what dominates it. Without a graph the activations are unknown,
    and so are the peak and what dominates it (None): a sum that left them out is no peak,
    and nothing prints it or filters by it. `mesh`, `algo`: the strategy's mesh and resolved
    collective algorithm, for the collectives' own buffers (timeline.py); `optimizer`,
    `optimizer_kwargs`: the step's optimizer, for its temporaries (timeline.py); `a2a`: the
    backend reduce-scatters by all-to-all (gloo: its receive blocks count); `device`: where the
    tensors are, for the optimizer's implementation (lowering/optimizers.py `step_impl`)."""
    parts = {"states": int(memory["total"]), "gathered": int(memory["transient"]),
             "activations": activation_bytes(graph, checkpoint) if graph is not None else None,
             "overhead": int(overhead)}
    if graph is None:
        return {**parts, "peak": None, "dominant": None}
    if plan is None:
        dominant = max(parts, key=parts.get)
        return {**parts, "peak": sum(parts.values()), "dominant": dominant}
    tl = timeline(plan, memory, parts["activations"], None if checkpoint else tuple(graph.saved),
                  graph.output, micro_batches, mesh, algo, optimizer, optimizer_kwargs, a2a,
                  logits=graph.logits, head=graph.head, device=device)
    at = tl.peak
    dominant = max(dict(at.buffers), key=dict(at.buffers).get)
    return {**parts, "peak": at.bytes + parts["overhead"], "dominant": dominant, "phase": at.phase,
            "buffers": dict(at.buffers), "timeline": tl.to_json()}
