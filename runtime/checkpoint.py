"""Checkpoints — stage: runtime. Strategy-independent state dicts for DCP.

Input: a `ShardedModule` (its flat groups and buffers) and its optimizers.
Output: `model_state_dict(sm)` / `load_model_state_dict(sm, sd)` behind
`sm.state_dict()` / `sm.load_state_dict()`, and the optimizer hooks that make
`opt.state_dict()` / `opt.load_state_dict()` speak the same language, so torch's own
`get_state_dict(sm, opt)`, `dcp.save`, `dcp.load`, `set_state_dict(...)` work unchanged.

[Note: the keys are torch's]
The model state dict has exactly the keys of the original model's `state_dict()`, in its
order: every parameter under each of its names (a tied parameter's aliases hold the same
piece, as torch's hold the same tensor), with its global, unpadded shape, and the
persistent buffers (non-persistent ones, such as a rotary embedding's `inv_freq`, are not
state, as in torch). Nothing else: no manifest, no key FSDP2 or a plain model would not
know. Optimizer states go the same way under `state.<name>.<key>` (torch's layout), with
torch's param groups (no field of shardc's own: DCP refuses a checkpoint that lacks any key
the loading side's state dict has, so one would stop FSDP2 -> shardc resumes).
Missing, unexpected and mis-shaped keys are torch's own error (`incompatible`). Padding,
unit boundaries, mesh and world size appear nowhere, so any strategy loads any other's
checkpoint, FSDP2's included. Trainable parameters are saved from the fp32 master (this
rank's OS chunk), frozen ones from the params shard (its P chunk).

[Note: uneven pieces as DCP chunks]
A rank's chunk of a unit's flat buffer covers an arbitrary element range [lo, hi) of a
parameter, not whole rows. `boxes` splits that range of a row-major tensor into at most
2·ndim−1 rectangular boxes, each a contiguous run of the range. A piece is a `DTensor`
(global shape = the parameter's) whose local tensor is a `_Flat` holding the range; DTensor
forwards DCP's `__create_write_items__` / `__create_chunk_list__` / `__get_tensor_shard__`
to its local tensor (the hook Megatron-FSDP's uneven DTensors use), and `_Flat` answers
with one chunk per box. Replicas write the same boxes and DCP's planner dedups them.
The pieces are clones: `dcp.load` fills them, and nothing live changes until
`set_state_dict` (or `load_state_dict`) has checked every name and shape.
"""
from __future__ import annotations

from math import prod

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .errors import RuntimeUsageError

OPTIM_CLASS = "shardc_optimizer"    # full_optim_state_dict()'s param-group entry: the optimizer class


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple, int, int]]:
    """(offsets, sizes, flat_lo, flat_hi) boxes covering elements [lo, hi) of `shape`."""
    if lo >= hi:
        return []
    if not shape:
        return [((), (), lo, hi)]
    inner = prod(shape[1:])
    r0, r1 = lo // inner, (hi - 1) // inner
    if lo % inner == 0 and hi % inner == 0:
        return [((r0,) + (0,) * (len(shape) - 1), (r1 - r0 + 1,) + tuple(shape[1:]), lo, hi)]
    if r0 == r1:
        base = r0 * inner
        return [((r0,) + o, (1,) + s, a + base, b + base)
                for o, s, a, b in boxes(tuple(shape[1:]), lo - base, hi - base)]
    head, tail = -(-lo // inner) * inner, (hi // inner) * inner
    return boxes(shape, lo, head) + boxes(shape, head, tail) + boxes(shape, tail, hi)


class _Flat(torch.Tensor):
    """A rank's elements [lo, hi) of a parameter-shaped tensor, flattened (DCP hooks)."""

    def __deepcopy__(self, memo):
        new = self.as_subclass(torch.Tensor).clone().as_subclass(_Flat)
        new._shardc_boxes, new._shardc_shape = list(self._shardc_boxes), self._shardc_shape
        memo[id(self)] = new
        return new

    def _chunks(self):
        for off, size, a, b in self._shardc_boxes:
            yield ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)), a, b

    def __create_chunk_list__(self):
        return [c for c, _, _ in self._chunks()]

    def __create_write_items__(self, fqn, obj):
        props = TensorProperties.create_from_tensor(self.as_subclass(torch.Tensor))
        return [WriteItem(index=MetadataIndex(fqn, c.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=c, properties=props,
                                                      size=self._shardc_shape))
                for c, _, _ in self._chunks()]

    def __get_tensor_shard__(self, index):
        plain = self.as_subclass(torch.Tensor)
        for c, a, b in self._chunks():
            if c.offsets == torch.Size(index.offset):
                return plain[a:b].view(c.sizes)
        raise ValueError(f"no local chunk of {index.fqn!r} at offset {tuple(index.offset)}")


def wrap(local: torch.Tensor, shape: tuple[int, ...], lo: int, device_mesh, tp=None) -> DTensor:
    """A DTensor of global `shape` whose local data are its flat elements [lo, lo+len); for
    a DTensor parameter (`tp`, a TPParam) `shape` is its local shard's, placed at the
    shard's offset in the parameter's global shape."""
    flat = local.detach().reshape(-1).as_subclass(_Flat)
    bx = boxes(shape, lo, lo + flat.numel())
    if tp is not None:
        bx = [(tuple(o + t for o, t in zip(off, tp.offset)), size, a, b) for off, size, a, b in bx]
        shape = tp.shape
    flat._shardc_boxes = [(o, s, a - lo, b - lo) for o, s, a, b in bx]
    flat._shardc_shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(device_mesh, (Replicate(),) * device_mesh.ndim,
                       tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype))
    return DTensor(flat, spec, requires_grad=False)


def local_piece(value, shape: tuple[int, ...], lo: int, hi: int, what: str, tp=None) -> torch.Tensor:
    """This rank's flat elements [lo, hi) of `what` (of local `shape`; a DTensor parameter's
    local shard when `tp` is its TPParam) from a loaded value: a piece made by `wrap` for
    the same range, or a full tensor of the parameter's global shape."""
    local_shape, shape = shape, (tp.shape if tp is not None else shape)
    if isinstance(value, DTensor) and isinstance(value._local_tensor, _Flat):
        local = value._local_tensor.as_subclass(torch.Tensor)
        if tuple(value.shape) != tuple(shape):
            raise RuntimeUsageError(f"{what} has shape {tuple(value.shape)} in the checkpoint, "
                                    f"but this model's is {tuple(shape)}")
        if local.numel() != hi - lo:
            raise RuntimeUsageError(f"{what}: the loaded piece has {local.numel()} elements, this "
                                    f"rank holds {hi - lo}; load through get_state_dict/dcp.load")
        return local
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise RuntimeUsageError(f"{what} is {got} in the checkpoint, but this model's shape "
                                f"is {tuple(shape)}")
    if tp is not None:
        value = tp.local_of(value)
    return value.detach().reshape(local_shape).reshape(-1)[lo:hi]


def _pieces(sm) -> dict[str, DTensor]:
    """Canonical parameter name -> this rank's piece of it (see [Note: uneven pieces as DCP
    chunks]): fp32 master of trainable parameters, params shard of frozen ones."""
    mesh = sm.comm.smesh.device_mesh
    pieces = {}
    for u in sm.runtime.units:
        for st in (g.storage for g in u.groups):
            src, start = st.checkpoint_chunk()
            for s, lo, hi in st.layout.ranges(start, src.numel()):
                first = start + lo - s.offset if hi > lo else 0
                pieces[s.fqn] = wrap(src[lo:hi].clone(), s.shape, first, mesh, sm.tp.get(s.fqn))
    return pieces


# -- model ------------------------------------------------------------------------------
def model_state_dict(sm) -> dict:
    """The original model's `state_dict()` keys, in its order (see [Note: the keys are
    torch's]): each parameter's piece, each persistent buffer. Local, except that under
    `buffers broadcast` rank 0's buffers are broadcast first if a training forward changed
    them (runtime/buffers.py)."""
    sm.buffer_sync.settle("state_dict()")
    pieces = _pieces(sm)
    bufs = dict(sm.module.named_buffers(remove_duplicate=False))
    return {k: pieces[sm.aliases[k]] if k in sm.aliases else bufs[k].detach().clone()
            for k in sm.state_keys}


def incompatible(cls_name: str, missing, unexpected, sizes=()) -> RuntimeError:
    """torch's own error for a state dict that does not fit (`nn.Module.load_state_dict`'s
    text): missing and unexpected keys, and (key, saved shape, this model's shape) triples."""
    msgs = []
    if missing:
        msgs.append("Missing key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in missing)))
    if unexpected:
        msgs.append("Unexpected key(s) in state_dict: {}. ".format(", ".join(f'"{k}"' for k in unexpected)))
    msgs += [f"size mismatch for {k}: copying a param with shape {torch.Size(a)} from checkpoint, "
             f"the shape in current model is {torch.Size(b)}." for k, a, b in sizes]
    return RuntimeError("Error(s) in loading state_dict for {}:\n\t{}".format(cls_name, "\n\t".join(msgs)))


def _fit(sm, sd: dict, strict: bool) -> tuple[list[str], list[str]]:
    """(missing, unexpected) keys of `sd` against the original model's; under `strict`
    either is torch's own error, as is any shape that differs (checked before anything
    changes)."""
    keys = set(sm.state_keys)
    missing = [k for k in sm.state_keys if k not in sd]
    unexpected = [k for k in sd if k not in keys]
    shapes = {k: tuple(v.shape) for k, v in sm.module.named_buffers(remove_duplicate=False)}
    for u in sm.runtime.units:
        for g in u.groups:
            shapes.update((a, sm.tp[s.fqn].shape if s.fqn in sm.tp else s.shape)
                          for s in g.storage.layout.slots for a in sm.names_of[s.fqn])
    sizes = [(k, tuple(sd[k].shape), shapes[k]) for k in sm.state_keys
             if k in sd and isinstance(sd[k], torch.Tensor) and tuple(sd[k].shape) != shapes[k]]
    if sizes or (strict and (missing or unexpected)):
        raise incompatible(type(sm.module).__name__, missing if strict else [],
                           unexpected if strict else [], sizes)
    return missing, unexpected


def load_model_state_dict(sm, sd: dict, strict: bool = True) -> tuple[list[str], list[str]]:
    """Check every name and shape, then write masters, shards and buffers; returns (missing,
    unexpected) keys as torch does. Collective over the OS∖P levels (the params shards are
    re-gathered from the loaded masters)."""
    missing, unexpected = _fit(sm, sd, strict)
    staged = []
    for u in sm.runtime.units:
        for g in u.groups:
            src, start = g.storage.checkpoint_chunk()
            new = src.detach().clone()
            for s, lo, hi in g.storage.layout.ranges(start, src.numel()):
                key = next((a for a in sm.names_of[s.fqn] if a in sd), None)
                if key is not None and hi > lo:
                    first = start + lo - s.offset
                    new[lo:hi].copy_(local_piece(sd[key], s.shape, first, first + hi - lo, repr(key),
                                                 sm.tp.get(s.fqn)))
            staged.append((u.index, g, new))
    keys = set(sm.state_keys)
    bufs = {name: sd[name] for name, _ in sm.module.named_buffers(remove_duplicate=False)
            if name in sd and name in keys}
    with torch.no_grad():
        for i, g, new in staged:
            sm.runtime.release(i)
            _commit(g, new)
        for name, buf in sm.module.named_buffers():
            if name in bufs:
                buf.copy_(bufs[name])
    return missing, unexpected


def _commit(g, new: torch.Tensor) -> None:
    """Write a group's loaded chunk; trainable: master, then the params shard as after a
    step (OS chunk cast into the shard, all-gathered over OS∖P; not recorded in the ledger)."""
    src, _ = g.storage.checkpoint_chunk()
    src.copy_(new)
    if g.trainable:
        g.update_issue(record=False).wait()


# -- optimizer ----------------------------------------------------------------------------
def _piece_info(opt, boundary, tp) -> list[tuple[str, tuple, int, int, object]]:
    """(name, parameter shape on this rank, lo, hi, its TPParam or None) per optimizer
    piece, lo/hi within the parameter."""
    out = []
    for piece in opt.shardc_pieces:
        slot = boundary.units[piece.unit].trainable.storage.layout.slot(piece.name)
        t = tp.get(piece.name)
        if slot is None or piece.start == piece.stop:
            out.append((piece.name, slot.shape if slot else (), 0, 0, t))
        else:
            out.append((piece.name, slot.shape, piece.start - slot.offset, piece.stop - slot.offset, t))
    return out


def attach_optimizer_hooks(opt, boundary, mesh, tp) -> None:
    """`opt.state_dict()` keeps only real parameters (padding dropped), each state tensor a
    parameter-shaped piece over DeviceMesh `mesh`; `opt.load_state_dict()` takes that,
    torch's FQN-keyed form from `set_state_dict`, or full parameter-shaped tensors."""
    info = _piece_info(opt, boundary, tp)
    cls = type(opt).__name__

    def order():
        where = {id(p): i for i, p in enumerate(opt.shardc_params)}
        return [info[where[id(p)]] for g in opt.param_groups for p in g["params"]]

    def save_hook(optimizer, sd):
        live = order()
        keep = {pid for pid, (name, *_) in enumerate(live) if not name.startswith("<padding>")}
        state = {}
        for pid, st in sd["state"].items():
            if pid in keep:
                _, shape, lo, hi, t = live[pid]
                state[pid] = {k: _saved(v, shape, lo, mesh, t) for k, v in st.items()}
        pgs = [dict(g, params=[p for p in g["params"] if p in keep]) for g in sd["param_groups"]]
        return {"state": state, "param_groups": pgs}

    def load_hook(optimizer, sd):
        return _to_torch_layout(optimizer, sd, order(), cls)

    opt.register_state_dict_post_hook(save_hook)
    opt.register_load_state_dict_pre_hook(load_hook)


def _saved(v, shape, lo, mesh, tp):
    """A state value as saved: tensors are copies (pieces for element-wise states)."""
    if isinstance(v, torch.Tensor) and v.dim() > 0:
        return wrap(v.clone(), shape, lo, mesh, tp)
    return _copy(v)


def _copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _to_torch_layout(opt, sd, live, cls) -> dict:
    """Validate everything, then give torch's load_state_dict its own pid-keyed layout."""
    pgs = sd.get("param_groups", [])
    if len(pgs) != len(opt.param_groups):
        raise RuntimeUsageError(f"the checkpoint has {len(pgs)} optimizer param groups, this "
                                f"optimizer {len(opt.param_groups)}")
    for g in pgs:
        saved = g.get(OPTIM_CLASS, cls)
        if saved != cls:
            raise RuntimeUsageError(f"the checkpoint holds {saved} optimizer state, but this "
                                    f"optimizer is {cls}; build the same optimizer class to resume")
    by_name = {}
    for key, st in sd.get("state", {}).items():
        name = live[key][0] if isinstance(key, int) else key
        by_name[name] = st
    live_params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for pid, ((name, shape, lo, hi, t), p) in enumerate(zip(live, live_params)):
        if name.startswith("<padding>"):
            if p in opt.state:
                state[pid] = {k: _copy(v) for k, v in opt.state[p].items()}
            continue
        st = by_name.get(name)
        if st is None:
            if by_name:
                raise RuntimeUsageError(f"the checkpoint has no optimizer state for {name!r}")
            continue
        state[pid] = {k: local_piece(v, shape, lo, hi, f"optimizer state {k!r} of {name!r}", t).clone()
                      if isinstance(v, torch.Tensor) and v.dim() > 0 else _copy(v) for k, v in st.items()}
    out_groups, pid = [], 0
    for g, live_g in zip(pgs, opt.param_groups):
        n = len(live_g["params"])
        hyper = {k: v for k, v in g.items() if k not in ("params", OPTIM_CLASS)}
        out_groups.append(dict(hyper, params=list(range(pid, pid + n))))
        pid += n
    return {"state": state, "param_groups": out_groups}
