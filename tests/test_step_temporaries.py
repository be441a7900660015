"""explain's optimizer-step temporaries follow the optimizer the user gives (issue 47):
one rule, shardc.lowering.optimizers `step_temporary_bytes` ([Note: step temporaries]).

- the rule's factors are what torch's `opt.step()` allocates, measured here with torch's
  MemTracker (AdamW foreach, the per-tensor loop and fused; SGD with momentum, and with
  weight decay), on 4 small fp32 tensors;
- explain's step point holds exactly the rule's bytes for the optimizer given (AdamW by
  default, fused AdamW, SGD with momentum): a timeline that dropped the rule, or kept one
  constant for every optimizer, fails.
"""
from __future__ import annotations

import os

import pytest
import torch

from shardc.lowering.optimizers import step_impl, step_temporary_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 1 << 16


def _measured(cls, **kw) -> tuple[int, int, int]:
    """(bytes opt.step() allocated beyond what it held, the stepped bytes, the largest tensor's)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
    params = [torch.nn.Parameter(torch.randn(2 * N if i == 0 else N)) for i in range(4)]
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
    return grew, sum(p.numel() * 4 for p in params), 2 * N * 4


@pytest.mark.parametrize("cls,kw", [
    (torch.optim.AdamW, {"foreach": True}), (torch.optim.AdamW, {"foreach": False}), (torch.optim.AdamW, {"fused": True}),
    (torch.optim.SGD, {"momentum": 0.9, "foreach": True}), (torch.optim.SGD, {"momentum": 0.9, "foreach": False}),
    (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.01, "foreach": True}),
])
def test_the_rule_is_what_torch_allocates(cls, kw):
    grew, stepped, largest = _measured(cls, **kw)
    assert grew == step_temporary_bytes(cls.__name__, kw, stepped, largest, device="cpu"), (cls.__name__, kw)


def test_torch_runs_foreach_on_gpus_and_the_loop_on_cpu_and_meta():
    assert step_impl({}, "cuda") == "foreach" and step_impl({}, "cpu") == step_impl({}, "meta") == "loop"
    assert step_impl({"fused": True}) == "fused" and step_impl({"foreach": False}) == "loop"


def test_explain_step_holds_the_optimizers_temporaries():
    """The step point: the rule's bytes for the optimizer and the device, and no update's
    clone where there is no update all-gather (zero3: P sharded as OS is)."""
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
        # the largest optimizer chunk and the largest parameter piece of one (fp32 bytes), by
        # hand: a unit's trainable elements padded to a multiple of the 2 ranks, over 2 (a
        # block's 6,304, its largest parameter 4,096)
        sizes = [sum(named[n].numel() for n in u.params if named[n].requires_grad) for u in units]
        chunk = max(-(-n // 2) for n in sizes) * 4
        piece = max(min(max(named[n].numel() for n in u.params), -(-n // 2)) for u, n in zip(units, sizes) if n) * 4
        return points[0]["buffers"], chunk, piece

    adamw, chunk, piece = step("zero3", "adamw")
    assert adamw["optimizer step temporaries"] == chunk            # AdamW foreach (a GPU): 1x the stepped bytes
    assert adamw["the update's clone of the chunk"] == 0           # P sharded as OS is: no update all-gather
    cpu, _, _ = step("zero3", "adamw", backend="gloo")
    assert cpu["optimizer step temporaries"] == 2 * piece < 2 * chunk   # the per-tensor loop (CPU): 2x the largest piece
    fused, _, _ = step("zero3", "adamw", {"fused": True})
    sgd, _, _ = step("zero3", "sgd", {"momentum": 0.9})
    assert fused.get("optimizer step temporaries", 0) == 0 and sgd.get("optimizer step temporaries", 0) == 0
