"""Test helper: how many matmuls run inside Inductor-compiled graphs, and how many eagerly.

    mc = MatmulCount()
    model = torch.compile(model, backend=mc.backend)     # or block.compile(backend=mc.backend)
    ...warm-up steps...
    with mc.step():                                      # counts one training step
        loss = model(x).sum(); loss.backward(); opt.step()
    mc.last                                              # Counts(compiled=..., eager=...) of it

[Note: what is counted, and why this way]
Compiled: `backend` is Inductor (`compile_fx`) with one change: its inner compile (called
once per AOTAutograd forward and backward graph, with the aten graph Inductor lowers)
counts the graph's matmul nodes (aten mm, addmm, bmm, baddbmm; `linear` and `matmul` are
decomposed by then) and wraps the compiled callable so that every *run* of the graph adds
that count. So a graph compiled once and run for every block counts once per run, and a
matmul that Inductor lowers to its own kernel (a Triton or C++ template) still counts:
the count does not depend on how Inductor lowers it.
Eager: a profiler over the step records every aten call; a matmul event (the same ops,
plus `linear`/`matmul`, counted once at their outermost call) counts as eager unless an
Inductor graph's `## Call CompiledFxGraph` region encloses it (a compiled graph calls
`aten::mm` through its extern kernels; those are the compiled ones above).
A TorchDispatchMode cannot do this: compiled graphs' extern kernels dispatch like eager
ops, so it cannot tell them apart, and running dynamo under one changes what it traces.
Count warm steps only: a step that compiles runs dynamo's and AOTAutograd's tracing,
whose fake-tensor matmuls the profiler records as eager.
AOTAutograd's cache is off under `backend`: a hit there would skip the inner compile,
and the count. Inductor's FX graph cache stays on (it is consulted inside the inner
compile, so a hit is counted like a miss; ranks and repeated runs share its entries).
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch._inductor.compile_fx import compile_fx, compile_fx_inner

aten = torch.ops.aten
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
EAGER_NAMES = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"}
COMPILED_REGION = "## Call CompiledFxGraph"


@contextlib.contextmanager
def _no_caches():
    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def graph_matmuls(gm: torch.fx.GraphModule) -> int:
    """Matmul nodes in an aten-level graph."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in MATMULS)


class Counts(NamedTuple):
    compiled: int              # matmuls run inside Inductor graphs
    eager: int                 # matmuls run eagerly


class MatmulCount:
    def __init__(self):
        self.compiled = 0          # matmuls run inside compiled graphs since `step()` began
        self.graphs = 0            # graphs Inductor compiled (forward and backward each count)
        self.last: Counts | None = None    # the last `step()` block's counts

    def _inner(self, gm, example_inputs, **kwargs):
        n = graph_matmuls(gm)
        with _no_caches():                     # a backward may be compiled lazily, here
            out = compile_fx_inner(gm, example_inputs, **kwargs)
        self.graphs += 1
        owner = out if hasattr(out, "current_callable") else None   # an OutputCode, or a function
        run = out.current_callable if owner is not None else out

        def counted(inputs):
            self.compiled += n
            return run(inputs)
        if owner is None:
            counted._boxed_call = True         # the boxed convention (one list of inputs)
            return counted
        owner.current_callable = counted
        return out

    def backend(self, gm, example_inputs):
        """A torch.compile backend: Inductor, counting the matmuls its graphs run."""
        with _no_caches():
            return compile_fx(gm, example_inputs, inner_compile=self._inner)

    @contextlib.contextmanager
    def step(self):
        """Count what runs inside the block (a training step) into `last`."""
        self.compiled = 0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            yield self
        self.last = Counts(self.compiled, eager_matmuls(prof.events()))


def eager_matmuls(events) -> int:
    """Outermost matmul calls not inside a compiled graph's region."""
    n = 0
    for e in events:
        if e.name not in EAGER_NAMES:
            continue
        p, outer, compiled = e.cpu_parent, True, False
        while p is not None:
            if p.name in EAGER_NAMES:
                outer = False
            if p.name.startswith(COMPILED_REGION):
                compiled = True
            p = p.cpu_parent
        n += outer and not compiled
    return n
