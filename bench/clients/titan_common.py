"""What the torchtitan harnesses share (bench stage: helpers of torchtitan_check.py and
torchtitan_moe_check.py; information only, torchtitan is no test dependency).

Input: torchrun's process group and the harnesses' state dicts. Output: the rank and world, a
rank-0 line, the pass mark and the relative error of two state dicts, every tensor plain
(a DTensor made whole), the optimizers both harnesses step, and the JSON form of a tensor.
Errors are relative: max over entries of ||a - b|| / ||b||; a check passes at
max(TOL, 3 x floor), the floor being the same error between two single-process runs that
sum the gradient in another order.
"""
from __future__ import annotations

OPTIMS = {"adamw": ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
          "sgd": ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01))}
TOL = 1e-5          # fp32 rounding of a different reduction order


def make_opt(kind: str, params):
    import torch
    cls, kw = OPTIMS[kind]
    return getattr(torch.optim, cls)(params, **kw)


def plain(d: dict) -> dict:
    import torch
    from torch.distributed.tensor import DTensor
    out = {}
    for k, v in d.items():
        if isinstance(v, DTensor):
            v = v.full_tensor()
        if isinstance(v, torch.Tensor):
            v = v.detach().clone()
        out[k] = v
    return out


def rel_err(got: dict, want: dict) -> tuple[float, str]:
    """Max over tensor entries of ||a - b|| / ||b||, and the worst key."""
    import torch
    worst, where = 0.0, ""
    for k, w in want.items():
        if not isinstance(w, torch.Tensor) or w.dim() == 0 or w.is_complex():
            continue
        g = got[k]
        e = float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12))
        if e > worst:
            worst, where = e, k
    return worst, where


def tol(floor: float) -> float:
    """Pass mark: float32 rounding (1e-5), or 3x the floor where the optimizer amplifies it
    (Adam's first steps move each element by about lr * sign(g): an element whose gradient
    is near zero flips with the summation order) or bf16 experts round it."""
    return max(TOL, 3 * floor)


def two_level(world: int) -> str:
    return f"node(2) > gpu({world // 2})"


def get_world() -> int:
    import torch.distributed as dist
    return dist.get_world_size()


def get_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank()


def say(line: str) -> None:
    if get_rank() == 0:
        print(line, flush=True)


def gather(obj) -> list:
    import torch.distributed as dist
    out = [None] * get_world()
    dist.all_gather_object(out, obj)
    return out


def verdict(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def error(e: Exception, every_rank: bool = False) -> dict:
    """A failed check as one line (the traceback on rank 0, or on every rank)."""
    if every_rank or get_rank() == 0:
        import traceback
        traceback.print_exc()
    return dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[:800]}", ok=False)


def jsonable(x):
    import torch
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return str(x)
