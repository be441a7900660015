"""The simulation's dtype check — stage: public API (`shardc simulate`).

Input: a meta model's forward and backward run under `dtype_check(model)`. Output:
nothing when every op would run on a real device; else a `ShardcError` naming the op,
the dtypes it got and the module that ran it.

[Note: meta kernels do not check dtypes]
A meta kernel computes shapes only: `mm(fp32, bf16)` or a bf16 `layer_norm` weight on an
fp32 input succeed on meta and fail on CPU and CUDA ("expected mat1 and mat2 to have the
same dtype", "mixed dtype (CPU)"). So a simulated step checks, as the real kernel does,
that the floating-point tensors of every op that does not promote types (the matrix
products, convolutions, normalizations and attention below) share one dtype; ops that
promote (add, mul, ...) are left alone. It is stricter than CPU's mixed-dtype
normalization path (an fp32 weight on a bf16 input), so a job it approves runs on any
device.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardc.dsl.errors import ShardcError

aten = torch.ops.aten
_SAME_DTYPE = {getattr(aten, n) for n in (
    "mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "dot", "matmul", "linear", "convolution",
    "native_layer_norm", "native_group_norm", "native_batch_norm", "_fused_rms_norm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "scaled_dot_product_attention") if hasattr(aten, n)}


class _Check(TorchDispatchMode):
    def __init__(self, where):
        super().__init__()
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _SAME_DTYPE:
            dtypes = {t.dtype for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.is_floating_point()}
            if len(dtypes) > 1:
                names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
                raise ShardcError(f"{func.overloadpacket.__name__} in {self.where()} gets tensors of "
                                  f"{names}: a real kernel refuses mixed dtypes there, so this job would fail "
                                  f"on its ranks (units of different params dtypes are cast at their "
                                  f"boundaries; a cast inside a module is the model's)")
        return func(*args, **kwargs)


@contextlib.contextmanager
def dtype_check(model: torch.nn.Module):
    """Check every op run inside ([Note: meta kernels do not check dtypes])."""
    names = {id(m): n or "the model's root module" for n, m in model.named_modules()}
    stack: list[str] = []

    def pre(mod, args):
        stack.append(names.get(id(mod), type(mod).__name__))

    def post(mod, args, out):
        if stack:
            stack.pop()
    handles = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
               torch.nn.modules.module.register_module_forward_hook(post)]
    try:
        with _Check(lambda: f"module {stack[-1]}" if stack else "the backward or the loss"):
            yield
    finally:
        for h in handles:
            h.remove()
