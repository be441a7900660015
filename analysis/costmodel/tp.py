"""Tensor parallelism in the cost model — what `explain --tp N` / `plan --tp N` assume.

Input: a model built on the meta device and the TP degree N. Output: the same model with
every parameter the plan below splits replaced by its shape on one tp rank, so that
everything the cost model reads from it — units, bucket sizes, unit sizes, memory per
rank, bytes per level, the traced FLOPs and activations — is that of the local TP shards,
as the runtime's are (it shards each DTensor's local shard, runtime/state/dtensor_params.py).

[Note: the plan --tp assumes]
Every non-root unit's module (a transformer block) splits its attention and MLP over tp:
in each direct child of the block holding two or more `nn.Linear`s, the last one (in
registration order: the output projection) is RowwiseParallel (weight split along its
inputs, bias replicated) and the others ColwiseParallel (weight and bias split along the
outputs) — torchtitan's and Megatron's plan, and what `examples/gpt.py`'s
`tensor_parallel` applies. Embeddings, norms and the head stay replicated. The runtime
never reads this: it takes the placements of the DTensors it is given. The time model
counts a rank's FLOPs on its shards (where the model traces with split heads, else
6·params·tokens over its shards) and no TP collective.
"""
from __future__ import annotations

import torch
from torch import nn

from shardc.dsl.errors import ShardcError


def split_for_tp(model: nn.Module, units, tp: int) -> nn.Module:
    """`model` (meta) with the plan's linears cut to one tp rank's shape (see Note)."""
    if tp == 1:
        return model
    for u in units[1:]:
        for mname in u.modules:
            for cname, child in model.get_submodule(mname).named_children():
                linears = [(n, m) for n, m in child.named_modules() if isinstance(m, nn.Linear)]
                if len(linears) < 2:
                    continue
                for k, (lname, lin) in enumerate(linears):
                    _split(lin, ".".join(p for p in (mname, cname, lname) if p), k == len(linears) - 1, tp)
    return model


def _split(lin: nn.Linear, fqn: str, row: bool, tp: int) -> None:
    dim = 1 if row else 0
    n = lin.weight.shape[dim]
    if n % tp:
        raise ShardcError(f"--tp {tp}: {fqn} has {n} {'inputs' if row else 'outputs'}, which do not split "
                          f"evenly over {tp} ranks")
    shape = list(lin.weight.shape)
    shape[dim] //= tp
    lin.weight = nn.Parameter(torch.empty(shape, device="meta"), lin.weight.requires_grad)
    if lin.bias is not None and not row:
        lin.bias = nn.Parameter(torch.empty(shape[0], device="meta"), lin.bias.requires_grad)
    if row:
        lin.in_features //= tp
    else:
        lin.out_features //= tp
