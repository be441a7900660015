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
counts a rank's FLOPs on its shards and no TP collective.

[Note: local head counts]
A rank of a split attention holds a block of its heads. A model that shapes q, k, v as
(`n_heads`, `head_dim`) with a fixed `head_dim` (torchtitan's Llama, `examples/llama.py`)
reads its head counts, which the TP recipe therefore divides ("adjust attention module to
use the local number of heads"); so does this cut, for every child it splits that has an
integer `head_dim`: its `HEAD_COUNTS` attributes are divided by tp (one sentence where they
do not divide). A model that infers the local count (`view(b, t, -1, head_dim)`: Hugging
Face, `examples/gpt.py`) reads none and traces as it is. A model that reads neither way —
it takes its head size from the full width — cannot be traced with split weights:
`explain`/`plan --tp` then refuse in one sentence rather than count no activations.
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
                _local_heads(child, ".".join(p for p in (mname, cname) if p), tp)
    return model


# The attributes a split attention's head counts go by (torchtitan, Megatron, Hugging Face).
HEAD_COUNTS = ("n_heads", "n_kv_heads", "n_head", "num_heads", "num_key_value_heads")


def _local_heads(module: nn.Module, fqn: str, tp: int) -> None:
    """`module`'s head counts made one tp rank's ([Note: local head counts])."""
    if not isinstance(getattr(module, "head_dim", None), int):
        return
    for attr in HEAD_COUNTS:
        n = getattr(module, attr, None)
        if not isinstance(n, int) or isinstance(n, bool):
            continue
        if n % tp:
            raise ShardcError(f"--tp {tp}: {fqn}.{attr} is {n}, which does not split evenly over {tp} ranks")
        setattr(module, attr, n // tp)


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
