"""Graph costs — FLOPs and saved activations of one micro-batch, from the model itself.

Input: a model built on the meta device, its units (root first, as `find_units`
returns them), the micro-batch shape (sequences × sequence length) and the compute
dtype, one for the model or one per unit. Output: `GraphCost` — forward and backward FLOPs (torch's
`FlopCounterMode`: matmuls, bmm and attention), and per unit the bytes autograd
saves for the backward (`saved_tensors_hooks`) and the bytes of its input. Nothing is
allocated: the forward and backward run on meta tensors.

[Note: what the trace counts]
- Attention runs as the fused flash kernel GPUs use (`aten._scaled_dot_product_flash_
  attention`, which has a meta kernel): it saves q, k, v, the output and the
  log-sum-exp, not the s×s score matrix the CPU math fallback would, and FlopCounterMode
  counts it as 4·b·h·s²·d forward (the causal mask not halved: the literature formula
  Lins and FlashAttention use).
- Model FLOPs (for MFU) = 3 × forward FLOPs (Megatron's convention, backward = 2 ×
  forward). Executed FLOPs = forward + backward as counted, plus one more forward of
  every checkpointed unit (activation recomputation).
- Mixture-of-experts layers that run their experts as one grouped matmul
  (`aten._grouped_mm`, what Hugging Face's MoE models and torchtitan call) count
  2·rows·k·n: the routed rows are tokens × top-k whatever the router picks, so the
  meta trace counts the active experts exactly (torch's counter has no formula for it
  and would count nothing). Its meta kernel accepts bf16 only, as the first CUDA kernel
  did; other dtypes are shaped through a bf16 view on meta (`meta_grouped_mm`), so an
  fp32 MoE traces too. An expert loop indexed by the routing (`nonzero`) cannot run on
  meta tensors: such a model falls back to 6·params·tokens, which counts every expert.
- Each unit computes in its own dtype (its params dtype, where the strategy's overrides
  give it one): its modules' tensors are cast to it, and its inputs and outputs are cast
  at its boundaries as the ranks cast them (units/casts.py, [Note: casts at unit
  boundaries]), so a bf16 block inside an fp32 root saves bf16 activations and hands fp32
  ones back.
- Saved bytes exclude parameters (they are model states) and count each tensor once
  (by storage); a tensor saved inside a non-root unit's forward belongs to that unit,
  anything else to the root unit.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from shardc.dsl.errors import ShardcError


@dataclass(frozen=True, slots=True)
class GraphCost:
    forward_flops: float          # one micro-batch, whole model (not per rank: every rank runs it)
    backward_flops: float
    unit_forward_flops: tuple     # per unit (root first): forward FLOPs inside it
    saved: tuple                  # per unit: bytes saved for the backward
    inputs: tuple                 # per unit: bytes of its forward input (0 for the root)
    tokens: int
    output: int = 0               # fp32 bytes of the model's output (the logits the loss reads)
    logits: int = 0               # the model's output in its own dtype (bf16 logits: half `output`)
    head: int = 0                 # elements of the root's parameters the forward uses after its last unit

    @property
    def model_flops(self) -> float:
        """FLOPs per micro-batch that MFU counts ([Note: what the trace counts])."""
        return 3 * self.forward_flops

    def executed_flops(self, checkpoint: bool = False) -> float:
        """FLOPs the hardware runs per micro-batch (recomputation included)."""
        extra = sum(self.unit_forward_flops[1:]) if checkpoint else 0.0
        return self.forward_flops + self.backward_flops + extra


def sample_input(model, batch: int, seq: int):
    """A meta input for `model`: token ids when it starts with an embedding; a model can
    also say `example_input(batch, seq)` itself."""
    import torch
    if hasattr(model, "example_input"):
        return model.example_input(batch, seq)
    first = next((m for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.Linear))), None)
    if isinstance(first, torch.nn.Embedding):
        return torch.zeros((batch, seq), dtype=torch.long, device="meta")
    raise ShardcError(f"cannot build a sample input for {type(model).__name__}: it does not start with an "
                      f"nn.Embedding; give the model an `example_input(batch, seq)` method")


def flash_sdpa_mode():
    """A TorchFunctionMode that runs F.scaled_dot_product_attention as the flash kernel
    (the trace's, and a simulated rank's step: shardc/simulate.py)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class FlashSDPA(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention and len(args) == 3 \
                    and kwargs.get("attn_mask") is None:
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    *args, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                    scale=kwargs.get("scale"))[0]
            return func(*args, **kwargs)
    return FlashSDPA()


def grouped_mm_flop(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of `aten._grouped_mm`: each row of `a` (or each slice of the contraction)
    meets one group's matrix, so the count is one plain matmul over all of `a`."""
    if len(a_shape) == 3 and len(b_shape) == 2:    # (G, m, k) × (k, cols): each group meets only its columns
        return 2 * a_shape[1] * a_shape[2] * b_shape[1]
    return 2 * math.prod(a_shape) * b_shape[-1]     # rows split, contraction split, or a batch of G matmuls


def meta_grouped_mm():
    """A TorchDispatchMode under which `aten._grouped_mm` on meta tensors of any float
    dtype takes its shape from the bf16 meta kernel (nothing runs on meta; the result
    keeps the inputs' dtype, and autograd, above this mode, saves the real inputs)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    op = torch.ops.aten._grouped_mm.default

    class MetaGroupedMM(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is op and args[0].is_meta and args[0].dtype != torch.bfloat16:
                a, b = (t.to(torch.bfloat16) for t in args[:2])
                return func(a, b, *args[2:], **kwargs).to(kwargs.get("out_dtype") or args[0].dtype)
            return func(*args, **kwargs)
    return MetaGroupedMM()


def unit_dtypes(strategy, units, dtype: str) -> tuple[str, ...]:
    """The compute dtype of each unit: `dtype` (the model's: the top-level params dtype, or
    plan's `--precision`) except where the unit's own params dtype differs from the
    strategy's top-level one (an override gave it one)."""
    top = strategy.scopes.params.dtype
    return tuple(u.scopes.params.dtype.value if u.scopes is not None and u.scopes.params.dtype != top
                 else dtype for u in units)


def trace(model, units, *, batch: int, seq: int, dtype="bf16") -> GraphCost:
    """Run one micro-batch forward and backward on meta tensors; see the module docstring.
    `dtype`: one for every unit, or a sequence of one per unit (`unit_dtypes`)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from shardc.units.casts import caller_of, install_boundary_casts

    table = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    dts = [table[d] for d in ((dtype,) * len(units) if isinstance(dtype, str) else dtype)]
    m = copy.deepcopy(model).to(device="meta", dtype=dts[0])
    depth = lambda i: 0 if i == 0 else 1 + depth(caller_of(units, i))      # noqa: E731
    for i in sorted(range(1, len(units)), key=depth):          # outer units first, nested ones after
        for name in units[i].modules:
            m.get_submodule(name).to(dts[i])
    mods = dict(m.named_modules())
    params = {p.untyped_storage()._cdata for p in m.parameters()}
    n = len(units)
    saved, inputs, fwd = [0] * n, [0] * n, [0.0] * n
    seen: set = set()
    current = [0]          # a stack: the unit whose forward is running is current[-1]
    counter = FlopCounterMode(display=False, custom_mapping={torch.ops.aten._grouped_mm: grouped_mm_flop})

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params and key not in seen:
            seen.add(key)
            saved[current[-1]] += t.untyped_storage().nbytes()
        return t

    handles = []
    for i, u in enumerate(units):
        if i == 0:
            continue
        for name in u.modules:
            handles.append(mods[name].register_forward_pre_hook(_enter(i, current, inputs, counter, fwd)))
            handles.append(mods[name].register_forward_hook(_leave(i, current, counter, fwd)))
    # after the unit hooks, prepended: a unit's input is counted as it arrives, cast
    handles += install_boundary_casts(m, units, dts)
    # the root's parameters used after the last unit ran: the head's, whose gradients the
    # loss's backward makes first (loss.py [Note: timeline: loss tensors])
    order: list = []
    for name, mod in mods.items():
        if any(name in u.modules for u in units[1:]):
            handles.append(mod.register_forward_hook(lambda *_: order.append(None)))
        elif any(p.requires_grad for p in mod.parameters(recurse=False)):
            handles.append(mod.register_forward_hook(
                lambda mod, *_: order.append(tuple(mod.parameters(recurse=False))) if current[-1] == 0 else None))
    x = sample_input(m, batch, seq)
    try:
        with meta_grouped_mm(), counter, flash_sdpa_mode(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = m(x)
            forward = counter.get_total_flops()
            logits = out if torch.is_tensor(out) else out[0]
            loss = logits.float().sum()
        with meta_grouped_mm(), counter, flash_sdpa_mode():   # entering the counter again starts from zero
            loss.backward()
            backward = counter.get_total_flops()
    finally:
        for h in handles:
            h.remove()
    fwd[0] = forward - sum(fwd[1:])
    last = max((k for k, e in enumerate(order) if e is None), default=-1)
    head = {id(p): p.numel() for e in order[last + 1:] for p in e if p.requires_grad}
    return GraphCost(float(forward), float(backward), tuple(fwd), tuple(saved), tuple(inputs), batch * seq,
                     logits.numel() * 4, logits.numel() * logits.element_size(), sum(head.values()))


def _enter(i, current, inputs, counter, fwd):
    def hook(mod, args):
        import torch
        current.append(i)
        inputs[i] = sum(a.untyped_storage().nbytes() for a in args if torch.is_tensor(a))
        fwd[i] -= counter.get_total_flops()
    return hook


def _leave(i, current, counter, fwd):
    def hook(mod, args, out):
        current.pop()
        fwd[i] += counter.get_total_flops()
    return hook
