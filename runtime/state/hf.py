"""Hugging Face weights straight into shards — stage: runtime (state).

Input: a ShardedModule (typically built on the meta device with `init=False` or
`init=shardc.buffers_only(model._init_weights)`) and a `save_pretrained` directory (one
`model.safetensors`, or several with their index). Output: the parameters and persistent
buffers loaded, each rank having read only the slices it keeps.

It is torch's own path: `dcp.load` of the module's state dict (its pieces: runtime/state/
pieces.py, whose DCP chunks are exactly the rank's element ranges) through
`HuggingFaceStorageReader`, which reads each chunk with safetensors' `get_slice`, then
`sm.load_state_dict` (the model's hooks, torch's checks). Only the keys the files hold are
asked of DCP, so a tied parameter saved once (GPT-2's `lm_head.weight`) comes from its other
name. A tensor the files lack, a mis-shaped one, or a failure inside DCP is one
sentence (runtime/state/load_errors.py), and the module keeps its values ([Note: nothing
half-loaded] there). Dtype: values take the strategy's `params dtype` (a bf16 checkpoint
loads into fp32 shards cast, as `load_state_dict` does); `dtype="checkpoint"` keeps the
files' dtype as `from_pretrained(torch_dtype="auto")` does, refusing a tensor the strategy
stores in another dtype. The shards are filled in place ([Note: loads in place] in
checkpoint.py).

[Note: which files a load reads]
One `.safetensors` file given: that file. A directory with `model.safetensors.index.json`:
exactly the files its `weight_map` names, as `from_pretrained` reads them, each tensor
checked to be in the file the index maps it to (a stale `model.safetensors` left beside a
sharded set by an earlier save is never read). A directory without an index: every
`.safetensors` file in it, and a tensor held by two of them is an error naming both (no
silent mix of two saves).
"""
from __future__ import annotations

import json
import os

import torch

from shardc.dsl.errors import ShardcError

SUFFIX = ".safetensors"
INDEX = "model.safetensors.index.json"


def load_safetensors(sm, path, strict: bool = False, dtype: str = "strategy") -> object:
    """See the module docstring; `strict`: tensors in the files that the model does not have
    are an error (default: ignored, as `from_pretrained` does with a warning). `dtype`:
    "strategy" (values cast to the strategy's params dtype) or "checkpoint" (the files'
    dtype is kept, as `from_pretrained(torch_dtype="auto")`: a tensor saved in another dtype
    than the strategy stores it in is refused, naming the `params ... dtype` to write)."""
    import torch.distributed.checkpoint as dcp

    from . import checkpoint, hf_reader, hooks
    from .load_errors import CheckpointError, check_shapes, checkpoint_errors, missing_keys

    where, files = checkpoint_files(os.fspath(path))
    owner = tensor_files(files)
    reader = hf_reader.reader(where, sorted(files))
    md = reader.read_metadata()
    v = sm.state_view
    target = hooks.saved_probes(v.module, v.targets, checkpoint.shapes(v))      # names, shapes; no copies
    extra = sorted(set(md.state_dict_metadata) - set(target))
    if strict and extra:
        raise CheckpointError(f"{where} holds {extra[0]!r}{_more(extra)} ({owner[extra[0]]}), which the model does "
                              f"not have; nothing was loaded (strict=False ignores such tensors)")
    check_shapes(md, {k: t for k, t in target.items() if k in md.state_dict_metadata}, where, owner)
    if dtype not in ("strategy", "checkpoint"):
        raise CheckpointError(f"load_safetensors: dtype={dtype!r} is not 'strategy' (cast to the strategy's "
                              f"params dtype) or 'checkpoint' (keep the files' dtype)")
    if dtype == "checkpoint":
        _same_dtype(v, md, where, owner)

    def fill(sd):
        with checkpoint_errors(where, model=sm):          # the staged path's pieces are views too
            dcp.load(sd, storage_reader=reader)

    sm.runtime.boundary.complete_updates()
    if checkpoint.load_in_place(v, set(md.state_dict_metadata), fill, where):
        from torch.nn.modules.module import _IncompatibleKeys
        return _IncompatibleKeys([], [])
    sd = {k: t for k, t in sm.state_dict().items() if k in md.state_dict_metadata}     # staged: hooks, TP
    fill(sd)
    try:
        return sm.load_state_dict(sd)
    except RuntimeError as e:
        one = missing_keys(e, where)
        if one is None:
            raise
        raise one from None


def _same_dtype(v, md, where: str, owner: dict) -> None:
    """dtype="checkpoint": every tensor loads in the dtype it was saved in, or one sentence."""
    from .load_errors import CheckpointError
    kept = {}
    for u in v.units:
        for g in u.groups:
            for slot in g.storage.layout.slots:
                for name in v.names_of.get(slot.fqn, [slot.fqn]):
                    kept[name] = g.storage.pdtype
    for name, meta in md.state_dict_metadata.items():
        saved = getattr(getattr(meta, "properties", None), "dtype", None)
        if name in kept and saved is not None and saved != kept[name]:
            short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(saved, str(saved))
            raise CheckpointError(
                f"{where} holds {name!r} in {str(saved).replace('torch.', '')} ({owner.get(name, where)}) and the "
                f"strategy keeps it in {str(kept[name]).replace('torch.', '')}; dtype='checkpoint' takes the "
                f"files' dtype, so write `params ... dtype {short}` in the strategy (or load with "
                f"dtype='strategy' to cast); nothing was loaded")


def _more(names) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def checkpoint_files(path: str) -> tuple[str, set[str]]:
    """(the checkpoint as messages name it, the .safetensors files to read): the one file
    given; else the files a directory's index maps to; else every .safetensors file of the
    directory ([Note: which files a load reads])."""
    if os.path.isfile(path):
        return path, {os.path.abspath(path)}
    if not os.path.isdir(path):
        raise ShardcError(f"load_safetensors: {path} is neither a save_pretrained directory nor a .safetensors file")
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = {os.path.abspath(os.path.join(path, n)) for n in weight_map.values()}
        gone = sorted(f for f in files if not os.path.isfile(f))
        if gone:
            raise ShardcError(f"load_safetensors: {index} maps tensors to {os.path.basename(gone[0])}, which is not "
                              f"in {path}; copy the whole save_pretrained directory")
        have = _holders(files)
        for name, file in weight_map.items():
            got = have.get(name, [])
            if os.path.abspath(os.path.join(path, file)) not in got:
                raise ShardcError(f"load_safetensors: {index} maps {name!r} to {file}, which does not hold it"
                                  + (f" ({os.path.basename(got[0])} does)" if got else "") + "; the directory was "
                                  "written by two saves: save it again into an empty directory")
        return path, files
    files = {os.path.abspath(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(SUFFIX)}
    if not files:
        raise ShardcError(f"load_safetensors: {path} holds no .safetensors file (pass a save_pretrained directory)")
    return path, files


def tensor_files(files) -> dict[str, str]:
    """tensor name -> the file that holds it (headers only); a tensor in two files is an
    error naming both, since nothing says which one is current."""
    owner: dict[str, str] = {}
    for name, where in _holders(files).items():
        if len(where) > 1:
            raise ShardcError(
                f"load_safetensors: {name!r} is in both {os.path.basename(where[0])} and "
                f"{os.path.basename(where[1])} of {os.path.dirname(where[0])}, and nothing says which one "
                f"is current; remove the stale file or save again into an empty directory")
        owner[name] = where[0]
    return owner


def _holders(files) -> dict[str, list[str]]:
    """tensor name -> the files (sorted) whose headers list it."""
    from safetensors import safe_open
    out: dict[str, list[str]] = {}
    for file in sorted(files):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                out.setdefault(name, []).append(file)
    return out
