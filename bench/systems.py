"""The systems under test (bench stage: system name + model -> a trainable wrapper).

Input: a system name (`fsdp2:full`, `fsdp2:hsdp`, `ddp`, `shardc:<name>` or
`shardc:<path.shard>`, optionally `@ring|@hierarchical|@ho-ring|@auto` to
override the strategy's `collectives`), the model, the cluster shape. Output: a `System` whose
`micro(i)` context does what a user would write for gradient accumulation, plus the
model-state bytes each rank holds and the step's ledger (shardc) or the peer's
collectives derived from its known algorithm (bench/peers.py).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import nn

from models import ROOT, block_modules
from shardc.dsl.ir import Collectives, Strategy

LR = 3e-4
ALGOS = tuple(c.value for c in Collectives)     # `shardc:NAME@ALGO` overrides `collectives`


@dataclass
class System:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    micro: object                 # micro(i, last) -> context manager for micro-batch i
    ledger: object = None         # () -> list of LedgerRecord-like (shardc), else None
    reset_ledger: object = None
    memory: object = None         # () -> bytes per rank (params + grads + optim)
    pending: object = None        # () -> extra gradient bytes held between micro-batches
    strategy: object = None       # shardc Strategy (for link bytes), else None
    extra: dict = field(default_factory=dict)


def tensor_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "to_local"):            # DTensor: what this rank actually holds
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Params + grads + optimizer-state tensors held by this rank (tied params once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += tensor_bytes(p)
        if p.grad is not None:
            total += tensor_bytes(p.grad)
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                total += tensor_bytes(v)
    return total


def fsdp2_pending_grad_bytes(model: nn.Module) -> int:
    """Unsharded gradients FSDP2 holds between micro-batches when gradient sync is off.

    With `set_requires_gradient_sync(False)` FSDP2 keeps each parameter's full-size
    gradient (on its unsharded parameter, or in `unsharded_accumulated_grad` with a
    reduce dtype) until the synchronising micro-batch; these are not visible through
    `model.parameters()`, whose sharded DTensors have no grad yet.
    """
    total = 0
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in get_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                up = getattr(fp, "_unsharded_param", None)
                for t in (up.grad if up is not None else None, fp.unsharded_accumulated_grad):
                    if t is not None:
                        total += t.numel() * t.element_size()
    return total


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)


def fsdp2(model: nn.Module, nodes: int, per_node: int, hybrid: bool) -> System:
    """FSDP2 `fully_shard` on each block, then the root (torchtitan's recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if hybrid:   # (replicate, shard): shard inside a node, replicate across nodes = HSDP
        mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (nodes * per_node,), mesh_dim_names=("shard",))
    for block in block_modules(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    def micro(i: int, last: bool):
        # The user's accumulation idiom: no reduce-scatter / all-reduce until the last.
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    opt = _adamw(model.parameters())
    return System("fsdp2:hsdp" if hybrid else "fsdp2:full", model, opt, micro,
                  memory=lambda: state_bytes(model, opt),
                  pending=lambda: fsdp2_pending_grad_bytes(model))


def ddp(model: nn.Module) -> System:
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrapped = DDP(model)

    def micro(i: int, last: bool):
        return contextlib.nullcontext() if last else wrapped.no_sync()

    opt = _adamw(wrapped.parameters())
    return System("ddp", wrapped, opt, micro, memory=lambda: state_bytes(wrapped, opt))


def strategy_path(spec: str) -> str:
    """`zero3` -> examples/strategies/zero3.shard; a path is returned as given."""
    if spec.endswith(".shard"):
        return spec
    return os.path.join(ROOT, "examples", "strategies", f"{spec}.shard")


def for_bench(strategy: Strategy, accumulate: int, algo: str | None = None) -> Strategy:
    """The strategy with the benchmark's `accumulate` (same for all systems), and with
    `collectives` set to `algo` when the system name asked for one (`NAME@ALGO`)."""
    return replace(strategy, accumulate=accumulate, collectives=Collectives(algo) if algo else strategy.collectives)


def shardc_system(model: nn.Module, spec: str, example, accumulate: int) -> System:
    import shardc

    spec, _, algo = spec.partition("@")
    if algo and algo not in ALGOS:
        raise ValueError(f"unknown collectives {algo!r} in shardc:{spec}@{algo}: use {', '.join(ALGOS)}")
    path = strategy_path(spec)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no strategy file {path}")
    strategy = for_bench(shardc.load_strategy(path, world_size=dist.get_world_size()), accumulate, algo or None)
    sm = shardc.compile(model, strategy, example_inputs=(example,))
    plan = getattr(sm, "plan", None)          # the resolved strategy (`collectives auto` decided)
    strategy = plan.strategy if plan is not None else strategy
    opt = sm.optimizer(torch.optim.AdamW, lr=LR, weight_decay=0.1)

    def micro(i: int, last: bool):
        return contextlib.nullcontext()    # shardc does partial sync per its strategy

    def memory():
        return int(sm.memory_report()["total"])

    return System(f"shardc:{spec}" + (f"@{algo}" if algo else ""), sm, opt, micro, ledger=sm.comm_ledger,
                  reset_ledger=sm.reset_comm_ledger, memory=memory, strategy=strategy,
                  extra={"mesh": [[l.name, l.size] for l in strategy.mesh.levels],
                         "collectives": strategy.collectives.value})


def build_system(name: str, model: nn.Module, nodes: int, per_node: int, example, accumulate: int) -> System:
    if name == "fsdp2:full":
        return fsdp2(model, nodes, per_node, hybrid=False)
    if name == "fsdp2:hsdp":
        return fsdp2(model, nodes, per_node, hybrid=True)
    if name == "ddp":
        return ddp(model)
    if name.startswith("shardc:"):
        return shardc_system(model, name.split(":", 1)[1], example, accumulate)
    raise ValueError(f"unknown system {name!r}: use fsdp2:full, fsdp2:hsdp, ddp, shardc:<strategy>")
