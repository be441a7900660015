"""DeepSpeed systems for the emulated-cluster benchmark: `deepspeed:zero1`, `zero2`, `zero3`,
`zeropp` (ZeRO-3 + hpZ over the node), the papers' own baselines (issue 49, docs/deepspeed.md).

Stage: bench systems (bench/peers/systems.py dispatches here). Input: the model, the cluster shape,
micro-batches. Output: a `System` whose `backward` and `opt` drive a DeepSpeed engine.

[Note: a DeepSpeed step in the worker's loop]
The worker divides each micro-batch's loss by `accumulate` and calls `sys_.backward(loss)`,
then `sys_.opt.step()` once. DeepSpeed wants `engine.backward` and `engine.step` after every
micro-batch (its step acts at the accumulation boundary only), and scales the loss by
1/gradient_accumulation_steps itself: so `backward` runs `engine.backward(loss,
scale_wrt_gas=False)` then `engine.step()`, and `opt.step`/`zero_grad` do nothing. Same
model, data, micro-batches and AdamW (lr, weight decay) as the FSDP2 and shardc systems; no
clipping (`gradient_clipping: 0`, DeepSpeed 0.19.8 defaults to 1.0), fp32.
The knobs are DeepSpeed's recommended ones (its Hugging Face integration's "auto" values for
a model of hidden size h): overlap_comm and contiguous_gradients on, reduce_bucket_size h²,
stage3_prefetch_bucket_size 0.9·h², stage3_param_persistence_threshold 10·h. The config is
put in the results (`extra["ds_config"]`). qwZ/qgZ are not set: DeepSpeed's
quantizer op has no CPU build ("This op had not been implemented on CPU backend", raised when
the engine is built with either key on).

[Note: MiCS in a scratch venv]
DeepSpeed 0.19.8 and 0.19.7 refuse `mics_shard_size` ("MiCS ZeRO-3 sharding has been
removed"). `deepspeed:mics` is for 0.19.6, the last release with MiCS, from a scratch venv:
`python -m venv --system-site-packages V; V/bin/pip install --no-deps deepspeed==0.19.6`,
then the benchmark under `V/bin/python` with `PYTHONPATH` at this checkout.
`mics_shard_size` is the node's ranks. On CPU it does not train: MiCS's parameter all-gather
runs in torch's coalescing manager, which gloo lacks ("Backend gloo does not implement
startCoalescing"; docs/BENCHMARKS.md). Kept for a cluster whose backend has it (NCCL).
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

DS_SYSTEMS = {"deepspeed:zero1": 1, "deepspeed:zero2": 2, "deepspeed:zero3": 3, "deepspeed:zeropp": 3,
              "deepspeed:mics": 3}      # MiCS: DeepSpeed <= 0.19.6 only ([Note: MiCS in a scratch venv])


def _hidden(model: nn.Module) -> int:
    widths = [m.in_features for m in model.modules() if isinstance(m, nn.Linear)]
    return max(widths) if widths else 1024


def ds_config(name: str, per_node: int, accumulate: int, micro_batch: int, hidden: int) -> dict:
    stage = DS_SYSTEMS[name]
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True,
            "reduce_bucket_size": hidden * hidden}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
                    stage3_param_persistence_threshold=10 * hidden)
    if name == "deepspeed:zeropp":
        zero["zero_hpz_partition_size"] = per_node
    if name == "deepspeed:mics":
        zero["mics_shard_size"] = per_node          # shards inside the node, replicas across nodes
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulate,
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_optimization": zero,
            "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


class _NoOpt:
    """The worker's `opt`: DeepSpeed's engine steps inside `backward` (see the Note)."""

    def __init__(self, inner):
        self.inner = inner
        self.state = {}

    def step(self):
        pass

    def zero_grad(self):
        pass


def _bytes(t) -> int:
    return t.numel() * t.element_size()


def deepspeed_system(name: str, model: nn.Module, nodes: int, per_node: int, accumulate: int,
                     micro_batch: int, adamw):
    from peers.system import System
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = ds_config(name, per_node, accumulate, micro_batch, _hidden(model))
    engine, dsopt, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()), config=cfg)

    def backward(loss):
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()

    def memory():
        # this rank's parameters (ZeRO-3: its partition), the fp32 partitions the optimizer
        # steps and their AdamW states; gradients are DeepSpeed's internal buffers, not counted
        total = sum(_bytes(getattr(p, "ds_tensor", p)) for p in engine.module.parameters())
        inner = getattr(dsopt, "optimizer", dsopt)
        for g in inner.param_groups:
            total += sum(_bytes(p) for p in g["params"])
        for st in inner.state.values():
            total += sum(_bytes(v) for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
        return total

    return System(name, engine, _NoOpt(dsopt), lambda i, last: contextlib.nullcontext(),
                  memory=memory, backward=backward,
                  extra={"ds_config": cfg, "deepspeed": deepspeed.__version__,
                         "memory_note": "params + fp32 partitions + AdamW states; no gradient buffers"})
