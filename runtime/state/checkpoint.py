"""Checkpoints — stage: runtime (state). Strategy-independent state dicts for DCP.

Input: a sharded model's `StateView` (runtime/state/__init__.py: its parameters' pieces, its
buffers, the original model and its state-dict hooks) and the optimizers over its parameters.
Output: `model_state_dict(v)` / `load_model_state_dict(v, sd)` behind
`v.state_dict()` / `v.load_state_dict()`, and the optimizer hooks that make
`opt.state_dict()` / `opt.load_state_dict()` speak the same language, so torch's own
`get_state_dict(v, opt)`, `dcp.save`, `dcp.load`, `set_state_dict(...)` work unchanged.

[Note: the keys are torch's]
The model state dict is what the original model's `state_dict()` gives, hooks included
(runtime/state/hooks.py, [Note: torch runs the model's hooks]): every parameter under
each of its names (a tied parameter's aliases hold the same piece, as torch's hold the
same tensor), with its global, unpadded shape, and the persistent buffers (non-persistent
ones, such as a rotary embedding's `inv_freq`, are not state, as in torch), and
`_extra_state`. Nothing else: no manifest, no key FSDP2 or a plain model would not know.
Optimizer states go the same way under `state.<name>.<key>` (torch's layout), with torch's
param groups (no field of shardc's own: DCP refuses a checkpoint that lacks any key the
loading side's state dict has, so one would stop FSDP2 -> shardc resumes). Missing,
unexpected and mis-shaped keys are torch's own error (`nn.Module.load_state_dict` runs
the checks). Padding, unit boundaries, mesh and world size appear nowhere, so any
strategy loads any other's checkpoint, FSDP2's included. Trainable parameters are saved
from the fp32 master (this rank's OS chunk), frozen ones from the params shard (its P
chunk), each as a `ShardcPiece` (runtime/state/pieces.py); an entry a model's hook computes
(a split, a cast) is a whole tensor, the same on every rank.

[Note: loads in place]
`load_in_place` (`shardc.load_safetensors`) hands DCP views of the live shards, so the read
fills them with no copy of the rank's share: a trainable group's fp32 master (its OS chunk),
a frozen group's params shard. Where the params are fp32 the master is a view of the params
shard, and where the shard holds more than the master (s_P < s_OS: PaRO-IIG, ZeRO-1/2) the
load reads the shard's whole range instead, which fills the master too; otherwise (a separate
master: params in bf16) each group's params shard is re-made from its master by the update
all-gather, one group at a time, as after a step (staging: that group's OS chunk and the
gather's output).

[Note: the recipe loads in place]
torch's own recipe, `sd = sm.state_dict()` (or `get_state_dict`), `dcp.load(sd, ...)`,
`sm.load_state_dict(sd)` (or `set_state_dict`), loads in place as FSDP2's does: each piece
`state_dict()` hands out views the live master (frozen: params shard), so `dcp.load` writes
the shards and nothing holds a copy of the rank's share. `load_model_state_dict` then finds
every value of a group viewing its own chunk at its parameter's place (`_written_in_place`)
and commits the group as it is: the unit's gathered buffer is dropped and the params shard
re-made from the master (the update all-gather; a no-op where the master is the shard). A
group given anything else (whole tensors, another model's pieces, a hook's computed entry)
is staged as before: its chunk cloned, filled, committed, dropped, one group at a time.
So `dcp.load` alone fills the masters; the second half completes the load where the params
shard is not the master (bf16 params, s_P < s_OS), as it always had to. DCP checks names
and shapes while it plans, before any read; a failure while it reads leaves part of the
pieces written, as in FSDP2 (runtime/state/load_errors.py [Note: nothing half-loaded]).
A state dict is views, as torch's `nn.Module.state_dict()` is: taken before a step, it
shows the values after it (save it before training on, as with FSDP2). The optimizer's
pieces (`_saved`) view its live state tensors, and a loaded piece that is a view of the
state tensor it replaces keeps that tensor (`_loaded`): no copy of the moments either.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..errors import RuntimeUsageError
from . import StateView, hooks
from .params import ShardParam
from .pieces import _Flat, gather, local_piece, wrap

OPTIM_CLASS = "shardc_optimizer"    # full_optim_state_dict()'s param-group entry: the optimizer class


def shapes(v: StateView) -> dict[str, tuple]:
    return _shapes(v)


def _shapes(v: StateView) -> dict[str, tuple]:
    return {n: p._shardc_spec.global_shape for n, p in v.params.params.items()}


def parameter_values(v: StateView, whole: set[str] | None) -> dict[str, torch.Tensor]:
    """Each parameter's value for the model's state-dict machinery: the whole tensor for the
    names in `whole` (None: all; gathered in parameter order, a collective), else this
    rank's piece (`ShardcPiece`), a view of the live shard ([Note: the recipe loads in place])."""
    mesh = v.comm.smesh.device_mesh
    out = {}
    for name, p in v.params.params.items():
        spec, local = p._shardc_spec, p.to_local()
        if whole is None or name in whole:
            out[name] = gather(v.comm, spec, local)
        else:
            out[name] = wrap(local, spec, mesh, v.comm, v.params)
    return out


# -- model ------------------------------------------------------------------------------
def model_state_dict(v: StateView) -> dict:
    """The original model's `state_dict()` (see [Note: the keys are torch's]). Local, except
    that under `buffers broadcast` rank 0's buffers are broadcast first if a training forward
    changed them (runtime/buffers.py), and that entries a model's hook computes gather their
    parameters."""
    v.buffer_sync.settle("state_dict()")
    whole = hooks.whole_needed(v.module, v.targets, _shapes(v))
    return hooks.save(v.module, v.targets, parameter_values(v, whole))


def load_model_state_dict(v: StateView, sd: dict, strict: bool = True):
    """torch checks every name and shape and runs the model's load hooks; then masters,
    shards and buffers are written. Returns torch's `_IncompatibleKeys`. Collective over the
    OS∖P levels (the params shards are re-gathered from the loaded masters)."""
    sd = _tied_filled(v, sd)
    error = None
    try:
        try:
            params, bufs, result = hooks.load(v.module, v.targets, _shapes(v), sd, strict)
        except RuntimeError as e:
            _renamed_missing(v, sd, e)
            raise
    except Exception as e:                  # noqa: BLE001 — re-raised below, on every rank
        error = e
    _agree(v, error)
    # a group whose every value is a view of its own chunk (the recipe's dcp.load wrote it
    # there) is committed as it is; any other is staged, one group at a time: every check has
    # run on every rank above, so committing group by group cannot leave a half-loaded model
    with torch.no_grad():
        for u in v.units:
            for g in u.groups:
                src, start = g.storage.checkpoint_chunk()
                if _written_in_place(g.storage, src, start, params):
                    v.release(u.index)
                    if g.trainable:
                        g.update_issue(record=False).wait()
                    continue
                new = src.detach().clone()
                for s, lo, hi in g.storage.layout.ranges(start, src.numel()):
                    value = params.get(s.fqn)
                    if value is not None and hi > lo:
                        first = start + lo - s.offset
                        new[lo:hi].copy_(local_piece(value, s.shape, first, first + hi - lo, repr(s.fqn),
                                                     v.tp.get(s.fqn)))
                v.release(u.index)
                _commit(g, new)
                del new
        for buf, value in bufs:
            buf.copy_(value)
    v.params.loaded(params)
    return result


def _written_in_place(st, src: torch.Tensor, start: int, params: dict) -> bool:
    """Whether every value given for this group's parameters is this rank's piece viewing
    the group's own chunk at the parameter's place: `sm.state_dict()`'s pieces after
    `dcp.load` filled them ([Note: the recipe loads in place]), so there is nothing to copy."""
    size = src.element_size()
    for s, lo, hi in st.layout.ranges(start, src.numel()):
        value = params.get(s.fqn)
        if value is None or hi <= lo:
            continue
        local = value._local_tensor if isinstance(value, DTensor) else None
        if not isinstance(local, _Flat) or local.dtype != src.dtype or local.numel() != hi - lo \
                or local.data_ptr() != src.data_ptr() + lo * size \
                or local.untyped_storage().data_ptr() != src.untyped_storage().data_ptr():
            return False
    return True


def load_in_place(v: StateView, have, fill, where: str) -> bool:
    """Fill this rank's shards in place from a checkpoint holding the keys `have`:
    `fill(sd)` (a `dcp.load`) writes straight into pieces that are views of the live
    masters / frozen shards, then each trainable group's params shard is re-made from its
    master as after a step ([Note: loads in place]). False (nothing done) where a model's
    own save hooks or tensor parallelism need the staged path (`load_model_state_dict`)."""
    from .load_errors import CheckpointError, missing, stem
    shapes = _shapes(v)
    if v.tp or hooks.whole_needed(v.module, v.targets, shapes) or hooks.renamed(v.module, v.targets, shapes):
        return False
    mesh = v.comm.smesh.device_mesh
    direct = {id(g.storage) for u in v.units for g in u.groups if g.trainable and _reads_shard(g.storage)}
    shard_pieces = {spec.name: (spec, local) for u in v.units for g in u.groups if id(g.storage) in direct
                    for spec, local in v.params.pieces(g.storage, shard=True)}
    sd, lost = {}, []
    for name, p in v.params.params.items():
        alias = next((n for n in v.names_of.get(name, [name]) if n in have), None)
        if alias is None:
            lost.append(name)
        else:
            spec, local = shard_pieces.get(name, (p._shardc_spec, p.to_local()))
            sd[alias] = wrap(local, spec, mesh, v.comm)
    bufs = {}
    keys = set(hooks.saved_keys(v.module, v.targets, shapes))
    for name, buf in v.module.named_buffers():
        if name in keys:
            if name in have:
                bufs[name] = buf
                sd[name] = buf.detach().clone()
            else:
                lost.append(name)
    if lost:
        raise missing(lost, where)
    for u in v.units:
        v.release(u.index)
    try:
        fill(sd)
    except CheckpointError as e:                  # shards partly written: unusable until a load
        v.params.expect_values(v.params.params)
        raise CheckpointError(f"{stem(str(e))}; the load failed part-way, so the "
                              f"model's parameters are unusable until a load succeeds") from None
    with torch.no_grad():
        for u in v.units:
            for g in u.groups:
                if g.trainable and id(g.storage) not in direct:
                    g.update_issue(record=False).wait()
        for name, buf in bufs.items():
            buf.copy_(sd[name])
    v.params.loaded(v.params.params)
    return True


def _reads_shard(st) -> bool:
    """Whether a load fills this trainable group's params shard itself rather than its
    master: the master is a view of the shard (params in fp32) and the shard holds more
    than the master (s_P < s_OS), so reading the shard's range from the checkpoint fills
    both with no update all-gather ([Note: loads in place])."""
    return not st.master_separate and st.s_p < st.s_os


def _tied_filled(v: StateView, sd):
    """A tied parameter given under one of its names is given under all of them (torch's
    broadcast_from_rank0 keeps one name per parameter object)."""
    fill = {}
    for names in v.names_of.values():
        given = next((n for n in names if n in sd), None)
        if given is not None:
            fill.update({n: sd[given] for n in names if n not in sd})
    if not fill:
        return sd
    out = type(sd)(sd) if isinstance(sd, dict) else dict(sd)
    out.update(fill)
    if hasattr(sd, "_metadata"):
        out._metadata = sd._metadata
    return out


def _agree(v: StateView, error: Exception | None) -> None:
    """Every rank loads, or none does: a rank's failed checks fail the load everywhere
    (with `broadcast_from_rank0` only rank 0 holds the dict, so the ranks can disagree)."""
    group = v.comm.smesh.dp_group()
    if group is None:
        if error is not None:
            raise error
        return
    said = [None] * dist.get_world_size(group)
    dist.all_gather_object(said, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    bad = next(((r, e) for r, e in enumerate(said) if e is not None), None)
    if bad is not None:
        raise RuntimeUsageError(f"load_state_dict failed on rank {bad[0]} of the mesh, so no rank loaded "
                                f"anything: {' '.join(bad[1].split())}")


def _renamed_missing(v: StateView, sd, error: RuntimeError) -> None:
    """A strict load missing only parameters whose own module saves them under other keys
    (a state-dict hook), with none of those keys in the dict: one sentence naming the
    module. torch's `set_model_state_dict(..., broadcast_from_rank0=True)` gives exactly
    that (it keeps only entries named like the model's parameters); any other miss is
    torch's own error."""
    if "Missing key(s)" not in str(error):
        return
    shapes = _shapes(v)
    _, _, result = hooks.load(v.module, v.targets, shapes, sd, strict=False)    # nothing live changes
    renamed = hooks.renamed(v.module, v.targets, shapes)
    by_alias = {a: n for n in renamed for a in v.names_of[n]}
    missing = list(result.missing_keys)
    if not missing or any(k not in by_alias for k in missing):
        return
    path, mod = hooks.hook_owner(v.module, by_alias[missing[0]])
    own = [k for k in hooks.saved_keys(v.module, v.targets, shapes)
           if not path or k.startswith(path + ".")]
    if any(k in sd for k in own):
        return
    raise RuntimeUsageError(
        f"the state dict has no {missing[0]!r}, which {type(mod).__name__} {path!r} saves under other keys "
        f"through its own state-dict hook, and not those keys either (torch's set_model_state_dict with "
        f"broadcast_from_rank0=True keeps only entries named like the model's parameters); give every rank "
        f"the dict (v.load_full_state_dict) or load through DCP (get_state_dict, dcp.load, set_state_dict)"
    ) from error


def _commit(g, new: torch.Tensor) -> None:
    """Write a group's loaded chunk; trainable: master, then the params shard as after a
    step (OS chunk cast into the shard, all-gathered over OS∖P; not recorded in the ledger)."""
    src, _ = g.storage.checkpoint_chunk()
    src.copy_(new)
    if g.trainable:
        g.update_issue(record=False).wait()


# -- optimizer ----------------------------------------------------------------------------
def _live(opt) -> list:
    return [p for g in opt.param_groups for p in g["params"]]


def attach_optimizer_hooks(opt) -> None:
    """`opt.state_dict()`: each state tensor of a shardc parameter a piece of the
    parameter's shape (`ShardcPiece`); `opt.load_state_dict()` takes that, torch's FQN-keyed
    form from `set_state_dict`, or whole parameter-shaped tensors."""
    cls = type(opt).__name__

    def save_hook(optimizer, sd):
        live = _live(optimizer)
        state = {}
        for pid, st in sd["state"].items():
            p = live[pid]
            state[pid] = {k: _saved(v, p) for k, v in st.items()} if isinstance(p, ShardParam) else st
        return {"state": state, "param_groups": sd["param_groups"]}

    def load_hook(optimizer, sd):
        return _to_torch_layout(optimizer, sd, cls)

    opt.register_state_dict_post_hook(save_hook)
    opt.register_load_state_dict_pre_hook(load_hook)


def _saved(value, p):
    """A state value as saved: element-wise state tensors as pieces viewing the live state (as
    torch's `opt.state_dict()` hands out the state itself), the rest copies."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        s = p._shardc_set
        return wrap(value.detach(), p._shardc_spec, s.comm.smesh.device_mesh, s.comm)
    return _copy(value)


def _copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _name(p) -> str | None:
    return p._shardc_spec.name if isinstance(p, ShardParam) else None


def _loaded(v, p, what: str, live=None) -> torch.Tensor:
    """This rank's elements of a loaded state tensor, with the padding its parameter's
    tensor carries (zeros: [Note: the padding rides on the last piece]); `live` itself
    where the loaded piece is a view of it (the recipe's dcp.load wrote it in place)."""
    spec = p._shardc_spec
    piece = local_piece(v, spec.shape, spec.lo, spec.hi, what, spec.tp)
    if isinstance(live, torch.Tensor) and live.dtype == piece.dtype and live.numel() == piece.numel() + spec.pad \
            and live.data_ptr() == piece.data_ptr() and live.device == piece.device:
        return live
    piece = piece.clone()
    if spec.pad:
        piece = torch.cat([piece, piece.new_zeros(spec.pad)])
    return piece


def _to_torch_layout(opt, sd, cls) -> dict:
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
    live = _live(opt)
    by_key = {}
    for key, st in sd.get("state", {}).items():
        name = _name(live[key]) if isinstance(key, int) and 0 <= key < len(live) else key
        by_key[key if name is None else name] = st
    state = {}
    for pid, p in enumerate(live):
        name = _name(p)
        st = by_key.get(pid if name is None else name)
        if st is None:
            if by_key and name is not None and p.requires_grad:
                raise RuntimeUsageError(f"the checkpoint has no optimizer state for {name!r}")
            continue
        if name is None:
            state[pid] = st
            continue
        have = opt.state.get(p, {})
        state[pid] = {k: _loaded(v, p, f"optimizer state {k!r} of {name!r}", have.get(k))
                      if isinstance(v, torch.Tensor) and v.dim() > 0 else _copy(v) for k, v in st.items()}
    out_groups, pid = [], 0
    for g, live_g in zip(pgs, opt.param_groups):
        n = len(live_g["params"])
        hyper = {k: v for k, v in g.items() if k not in ("params", OPTIM_CLASS)}
        out_groups.append(dict(hyper, params=list(range(pid, pid + n))))
        pid += n
    return {"state": state, "param_groups": out_groups}
