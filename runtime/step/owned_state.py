"""Checkpoints of tensor-owned optimizer states — stage: runtime.

Input: an optimizer stepping whole tensors (runtime/step/owned.py `OwnedStep`: each owned
matrix's state whole on its owner, keyed by its stand-in; a whole piece's keyed by its
view's stand-in) and torch's optimizer state-dict calls. Output: the same states as every
element-wise optimizer's (runtime/state/checkpoint.py): keyed by the `ShardParam`s, each
state tensor this rank's chunk of the parameter, so `opt.state_dict()`, torch's
`get_state_dict`/`set_state_dict`, DCP and `full_optim_state_dict()` see nothing of the
owners, and a checkpoint saved under one layout resumes under any other (tensor-owned
over other levels or another world size, whole pieces under `optim replicate`).

[Note: owned states in checkpoints]
A checkpoint holds no owner: before a save (`opt.state_dict()`'s pre-hook) each owner
scatters its matrices' whole state tensors into every holder's chunk (the update's
all-to-all, `from_owners`, not recorded in the ledger: a checkpoint's traffic is not a
step's), the optimizer's state is keyed by the ShardParams for the save and the owners'
whole states come back after it (its post-hook; nothing else changed them). A load
(torch's `load_state_dict` given the chunks by checkpoint.py's pre-hook) is followed by
the reverse (`to_owners`): the chunks go to the owners, which key the whole tensors by
their stand-ins. Which matrices have state and its keys are the owner's to know: they are
exchanged as objects first (one all-gather per owner group), so every rank runs the same
collectives. A state tensor not of its parameter's size (Shampoo's preconditioners) is
refused in one sentence; 0-dim tensors and numbers are copied as they are.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..errors import RuntimeUsageError
from .owned import from_owners, step_of, to_owners


def attach(opt) -> None:
    """The state-dict hooks of an optimizer stepping whole tensors."""
    opt.register_state_dict_pre_hook(_before_save, prepend=True)
    opt.register_state_dict_post_hook(_after_save)
    opt.register_load_state_dict_post_hook(_after_load)


@contextmanager
def as_chunks(opt):
    """Within: `opt.state` keyed by the ShardParams, each state tensor this rank's chunk
    ([Note: owned states in checkpoints]); after: the owners' whole states again."""
    stash = _to_chunks(opt)
    try:
        yield
    finally:
        _restore(opt, stash)


def _before_save(opt) -> None:
    step = step_of(opt)
    if step is not None:
        step.checkpoint_stash = _to_chunks(opt)


def _after_save(opt, sd):
    step = step_of(opt)
    if step is not None and step.checkpoint_stash is not None:
        _restore(opt, step.checkpoint_stash)
        step.checkpoint_stash = None
    return None


def _describe(value, numel: int, name: str, key: str):
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if value.numel() != numel:
            return ("bad", tuple(value.shape))
        return ("t", value.dtype)
    return ("v", value.clone() if isinstance(value, torch.Tensor) else value)


def _to_chunks(opt):
    step = step_of(opt)
    if step is None:
        return None
    state, stash = opt.state, {}
    for g in step.groups:
        mine = {t.name: (t, state.get(step.stand_ins[t.name])) for t, _ in g.mine()}
        meta = {n: {k: _describe(v, t.numel, n, k) for k, v in st.items()} for n, (t, st) in mine.items() if st}
        if g.pg is not None:
            said = [None] * dist.get_world_size(g.pg)
            dist.all_gather_object(said, meta, group=g.pg)
            meta = {n: m for part in said for n, m in part.items()}
        bad = next(((n, k, d[1]) for n, m in sorted(meta.items()) for k, d in m.items() if d[0] == "bad"), None)
        if bad is not None:
            raise RuntimeUsageError(
                f"{type(opt).__name__}'s state {bad[1]!r} of {bad[0]!r} has shape {bad[2]}, not its parameter's "
                f"size, so a checkpoint cannot place it in the parameter's chunks; only states shaped like their "
                f"parameter (Muon's momentum) are checkpointed under `optim ... by tensor`")
        keys = {n: sorted(k for k, d in m.items() if d[0] == "t") for n, m in meta.items()}
        wholes = {n: tuple(st[k] for k in keys[n]) if st else () for n, (t, st) in mine.items()}
        back = from_owners(g, wholes, {t.name: len(keys.get(t.name, ())) for t, _ in g.items}, None)
        for t, p in g.items:
            if t.name not in meta:
                continue
            new = {}
            for k, d in meta[t.name].items():
                if d[0] == "t":
                    new[k] = _padded(back[t.name][keys[t.name].index(k)], p).to(d[1])
                else:
                    new[k] = d[1]
            stash[p] = None
            state[p] = new
        for t, _ in g.mine():
            s = step.stand_ins[t.name]
            if s in state:
                stash[s] = state.pop(s)
    for name, p in step.views.items():
        s = step.stand_ins[name]
        if s in state:
            st = stash[s] = state.pop(s)
            stash[p] = None
            state[p] = {k: _padded(v.reshape(-1), p) if isinstance(v, torch.Tensor) and v.dim() > 0 else v
                        for k, v in st.items()}
    return stash


def _padded(flat: torch.Tensor, p) -> torch.Tensor:
    """A chunk as the parameter's local tensor holds it: its padding zeros after it."""
    n = p.to_local().numel()
    out = flat.new_zeros(n)
    out[:min(n, flat.numel())] = flat[:n]
    return out


def _restore(opt, stash) -> None:
    if stash is None:
        return
    for key, value in stash.items():
        if value is None:
            opt.state.pop(key, None)
        else:
            opt.state[key] = value


def _after_load(opt) -> None:
    """The loaded chunks (keyed by the ShardParams) to the owners, keyed by the stand-ins."""
    step = step_of(opt)
    if step is None:
        return
    state = opt.state
    for g in step.groups:
        have = {t.name: state.pop(p, None) for t, p in g.items}
        keys = {n: sorted(k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0)
                for n, st in have.items() if st}
        pieces = {t.name: tuple(have[t.name][k] for k in keys.get(t.name, ())) for t, _ in g.items}
        wholes = to_owners(g, pieces, None)
        for t, _ in g.mine():
            st = have[t.name]
            if not st:
                continue
            new = {k: v for k, v in st.items() if k not in keys[t.name]}
            for i, k in enumerate(keys[t.name]):
                new[k] = wholes[t.name][i].view(t.shape).to(st[k].dtype)
            state[step.stand_ins[t.name]] = new
    for name, p in step.views.items():
        st = state.pop(p, None)
        if st:
            spec = p._shardc_spec
            state[step.stand_ins[name]] = {
                k: v.reshape(-1)[:spec.numel].view(tuple(spec.global_shape)).clone()
                if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in st.items()}
