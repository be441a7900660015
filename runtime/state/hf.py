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
name, and any other key the files lack is torch's own missing-key error.
"""
from __future__ import annotations

import os

from shardc.dsl.errors import ShardcError


def load_safetensors(sm, path) -> object:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = os.fspath(path)
    if os.path.isfile(path):
        path = os.path.dirname(path) or "."
    if not os.path.isdir(path) or not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise ShardcError(f"load_safetensors: {path} holds no .safetensors file (pass a save_pretrained directory)")
    reader = HuggingFaceStorageReader(path)
    have = set(reader.read_metadata().state_dict_metadata)
    sd = {k: v for k, v in sm.state_dict().items() if k in have}
    dcp.load(sd, storage_reader=reader)
    return sm.load_state_dict(sd)
