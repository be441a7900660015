"""Memory report — stage: runtime. What `ShardedModule.memory_report()` measures.

Input: the engine's units (their flat groups' stored tensors) and the optimizers built over
the module's parameters. Output: bytes per rank by state (`params`, `params_secondary`,
`grads`, `optim`, `total`), measured from the tensors actually held (docs/internals.md
"Memory"): the same keys and figures as `shardc explain`.
"""
from __future__ import annotations

import torch


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def held_tensors(engine, params=None) -> list[torch.Tensor]:
    """Every tensor the units' storages hold (shards, secondary copies, grad shards, fp32
    masters, and the full buffers, whose storage is empty between gathers), and with
    `params` (the ParamSet) the gradients the optimizer reads (views of the grad shard, or
    fp32 copies of its optimizer slice when it is kept in bf16: held, and not in
    `memory_report()`): what a memory tracker entered after construction must be told
    about (shardc/simulate.py)."""
    out = []
    for u in engine.units:
        for st in (g.storage for g in u.groups):
            out += [t for t in (st.full_made, st.shard, st.secondary) if t is not None]
            if st.trainable:
                out += ([st.grad_shard] if st.grad_allocated else []) + ([st.master] if st.master_separate else [])
    if params is not None:
        out += [views[1] for views in params.grads.made()]
    return out


def memory_report(engine, optimizers) -> dict[str, int]:
    rep = {"params": 0, "params_secondary": 0, "grads": 0, "optim": 0}
    for u in engine.units:
        for st in (g.storage for g in u.groups):
            rep["params"] += _nbytes(st.shard)
            rep["params_secondary"] += _nbytes(st.secondary)
            if st.trainable:
                rep["grads"] += st.grad_nbytes          # allocated at the first backward (runtime/groups/storage.py)
                if st.master_separate:
                    rep["optim"] += _nbytes(st.master)
    seen = set()
    for opt in optimizers:
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0 and id(v) not in seen:
                    seen.add(id(v))
                    rep["optim"] += _nbytes(v)
    rep["total"] = sum(rep.values())
    return rep
