"""What every system under test returns (bench stage: a wrapped model -> `System`), and the
model-state counters the systems share.

Input: a wrapped model and its optimizer. Output: `System` (what a worker trains and asks for
bytes), `state_bytes` (params + grads + optimizer states this rank holds),
`fsdp2_pending_grad_bytes` (FSDP2's unsharded gradients between micro-batches) and `adamw` (the
one optimizer every system steps). A leaf: systems.py, ep_systems.py and ds_systems.py import
it, so none of them imports another to build its `System`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

LR = 3e-4


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
    tp: int = 1                   # tensor-parallel degree: ranks rank//tp*tp.. read one batch
    extra: dict = field(default_factory=dict)
    backward: object = None       # (loss) -> None instead of loss.backward() (bench/peers/ds_systems.py)


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
                        total += tensor_bytes(t)
    return total


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
