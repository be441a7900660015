"""explain's optimizer-step temporaries follow the optimizer the user gives (issue 47):
one rule, shardc.lowering.optimizers `step_temporary_bytes` ([Note: step temporaries]).

- the rule's factors are what torch's `opt.step()` allocates, measured here with torch's
  MemTracker (AdamW foreach, the per-tensor loop and fused; SGD with momentum, and with
  weight decay), on 4 small fp32 tensors in two orders (the loop's rule reads each tensor
  and the one before it);
- explain's step point holds exactly the rule's bytes for the optimizer and the device
  given (AdamW by default, foreach on a GPU, the loop on CPU over each rank's pieces in step
  order, worked out here by hand; fused AdamW, SGD with momentum), and no update's clone
  beside them: a timeline that dropped the rule, kept one constant for every optimizer, or
  counted the clones within opt.step(), fails.
"""
from __future__ import annotations

import os

import pytest
import torch

from shardc.lowering.optimizers import step_impl, step_temporary_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 1 << 16


def _measured(cls, sizes, **kw) -> tuple[int, int, list[int]]:
    """(bytes opt.step() allocated beyond what it held, the stepped bytes, each tensor's bytes
    in step order) for fp32 tensors of `sizes` elements."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = cls(params, lr=1e-3, **kw)
    opt.step()                                   # the states exist before the measured step
    tracker = MemTracker()
    tracker.track_external(*params, opt)
    with tracker:
        opt.step()
    cpu = torch.device("cpu")
    grew = tracker.get_tracker_snapshot("peak")[cpu][_TOTAL_KEY] - tracker.get_tracker_snapshot()[cpu][_TOTAL_KEY]
    return grew, sum(n * 4 for n in sizes), [n * 4 for n in sizes]


@pytest.mark.parametrize("cls,kw", [
    (torch.optim.AdamW, {"foreach": True}), (torch.optim.AdamW, {"foreach": False}), (torch.optim.AdamW, {"fused": True}),
    (torch.optim.SGD, {"momentum": 0.9, "foreach": True}), (torch.optim.SGD, {"momentum": 0.9, "foreach": False}),
    (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.01, "foreach": True}),
    (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.01, "foreach": False}),
])
@pytest.mark.parametrize("sizes", [(2 * N, N, N, N), (N, 2 * N, N, N)])
def test_the_rule_is_what_torch_allocates(cls, kw, sizes):
    """In both orders: the loop's rule reads the tensor before the largest (AdamW: N + 2 x 2N
    when a tensor of N comes first, not 2 x 2N)."""
    grew, stepped, tensors = _measured(cls, sizes, **kw)
    assert grew == step_temporary_bytes(cls.__name__, kw, stepped, tensors, device="cpu"), (cls.__name__, kw, grew)


def test_torch_runs_foreach_on_gpus_and_the_loop_on_cpu_and_meta():
    assert step_impl({}, "cuda") == "foreach" and step_impl({}, "cpu") == step_impl({}, "meta") == "loop"
    assert step_impl({"fused": True}) == "fused" and step_impl({"foreach": False}) == "loop"


def test_explain_step_holds_the_optimizers_temporaries():
    """The step point: the rule's bytes for the optimizer and the device, and no update's
    clone beside them (made after opt.step() returns)."""
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.analysis.costmodel.flops import trace
    from shardc.analysis.costmodel.report import explain, model_units
    from shardc.cli.loader import build_model
    from shardc.dsl import load_strategy
    from shardc.units import find_units

    model = build_model(os.path.join(ROOT, "examples", "gpt.py") + ":tiny", device="meta")
    named = dict(model.named_parameters())

    def step(strategy, optimizer, kw=None, backend="nccl"):
        s = load_strategy(os.path.join(ROOT, "examples", "strategies", f"{strategy}.shard"), mesh="node(1) > gpu(2)")
        graph = trace(model, find_units(model, resolve_bucket(model, s)), batch=1, seq=16)
        units = find_units(model, resolve_bucket(model, s))
        e = explain(s, model_units(s, model), micro_batches=1, optimizer=optimizer, optimizer_kwargs=kw,
                    graph=graph, backend=backend)
        points = [p for p in e.peak["timeline"] if p["phase"] == "step"]
        assert len(points) == 1
        # by hand: a unit's trainable elements padded to a multiple of the 2 ranks; rank r's
        # OS chunk [r x n/2, (r + 1) x n/2) of each unit's flat group (parameters packed in
        # order); each parameter's piece of it, in the model's order; the loop's AdamW rule
        # on each rank: the largest of a piece's 2x plus the previous piece's 1x
        sizes = [sum(named[n].numel() for n in u.params if named[n].requires_grad) for u in units]
        chunk = max(-(-n // 2) for n in sizes) * 4
        order = {n: k for k, n in enumerate(named)}
        loop = 0
        for r in range(2):
            got = []
            for u, n in zip(units, sizes):
                lo, hi, off = r * -(-n // 2), (r + 1) * -(-n // 2), 0
                for name in u.params:
                    a, b = max(lo, off), min(hi, off + named[name].numel())
                    got.append((order[name], max(b - a, 0) * 4))     # an empty piece is stepped too
                    off += named[name].numel()
            seq = [b for _, b in sorted(got)]
            loop = max(loop, max(2 * b + p for p, b in zip([0] + seq, seq)))
        return points[0]["buffers"], chunk, loop

    adamw, chunk, loop = step("zero3", "adamw")
    assert adamw["optimizer step temporaries"] == chunk            # AdamW foreach (a GPU): 1x the stepped bytes
    assert not any("clone" in k for k in adamw)   # the update's clones come after opt.step(), its gathers' point
    cpu, _, _ = step("zero3", "adamw", backend="gloo")
    assert cpu["optimizer step temporaries"] == loop < 2 * chunk   # the per-tensor loop (CPU), pieces in step order
    fused, _, _ = step("zero3", "adamw", {"fused": True})
    sgd, _, _ = step("zero3", "sgd", {"momentum": 0.9})
    assert fused.get("optimizer step temporaries", 0) == 0 and sgd.get("optimizer step temporaries", 0) == 0
