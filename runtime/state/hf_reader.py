"""safetensors read into the shards — stage: runtime (state).

Input: the `.safetensors` files a load reads (runtime/state/hf.py decides which) and DCP's
read items, each resolved by the planner to its target: a view of a live shard (a load in
place) or of a staged piece. Output: torch's `HuggingFaceStorageReader` with one change,
how a read item's bytes reach its target.

[Note: reads straight into the shard]
torch's reader takes each item's box with safetensors' `get_slice(...)[box]`, which maps
the file (its pages then count in the process's resident memory) and returns a new tensor
of the box, copied into the target afterwards: two box-sized copies beside the shards, the
largest the rank's part of the embedding. A safetensors file is an 8-byte header length, a
JSON header giving each tensor's dtype, shape and byte range, then the tensors row-major.
A rank's box (runtime/state/pieces.py [Note: uneven pieces as DCP chunks]) is one contiguous
run of the tensor's elements, so its bytes are one contiguous range of the file: where the
target is a contiguous CPU tensor of the file's dtype, `readinto` fills it with no staging
at all; otherwise (another dtype, another device) the range is read in blocks of at most
`BLOCK` bytes into one staging buffer and copied (cast) in, so the staging is bounded
whatever the tensor's size. A box that is not contiguous in the file (a DTensor's column
shard) goes through torch's own `get_slice` path.
"""
from __future__ import annotations

import json
import os
import struct
from math import prod

import torch

from shardc.lowering.startup import LOAD_BLOCK as BLOCK   # the staging bound of a cast or off-CPU read

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


def header(path: str) -> tuple[int, dict]:
    """(the byte where the tensors begin, the JSON header) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def file_range(shape, offsets, lengths) -> tuple[int, int] | None:
    """(first element, count) of a box of a row-major tensor when its elements are one
    contiguous run, else None: every dim after the last one the box does not span whole is
    whole, and every dim before it has length 1."""
    shape, offsets, lengths = list(shape), list(offsets), list(lengths)
    cut = [d for d in range(len(shape)) if offsets[d] != 0 or lengths[d] != shape[d]]
    if cut and any(lengths[d] != 1 for d in range(cut[-1])):
        return None
    strides = [prod(shape[d + 1:]) for d in range(len(shape))]
    return sum(o * s for o, s in zip(offsets, strides)), prod(lengths)


def _read_exact(f, view: memoryview) -> None:
    while len(view):
        got = f.readinto(view)
        if not got:
            raise OSError(f"{f.name} ends early: the file is truncated")
        view = view[got:]


def read_box(f, base: int, dtype: torch.dtype, first: int, count: int, target: torch.Tensor) -> None:
    """Elements [first, first + count) of a tensor stored from byte `base` of the open file
    `f`, into `target` (count elements): in place or through one bounded block."""
    size = torch.empty((), dtype=dtype).element_size()
    f.seek(base + first * size)
    flat = target.view(-1)                      # contiguous (the caller's check)
    if flat.device.type == "cpu" and flat.dtype == dtype:
        if count:
            _read_exact(f, memoryview(flat.view(torch.uint8).numpy()))
        return
    step = max(1, BLOCK // size)
    block = torch.empty(min(step, count), dtype=dtype)
    for a in range(0, count, step):
        b = min(a + step, count)
        chunk = block[:b - a]
        _read_exact(f, memoryview(chunk.view(torch.uint8).numpy()))
        flat[a:b].copy_(chunk)


def metadata(files: list[str], load_id=None):
    """torch's `HuggingFaceStorageReader.read_metadata`, from the files' JSON headers alone
    (safetensors' `safe_open` maps each file, and on the coordinating rank that cost a
    transient 25 MiB on the 124.7M Llama)."""
    from safetensors.torch import _getdtype
    from torch.distributed.checkpoint._hf_utils import (CUSTOM_METADATA_KEY, SAVED_OFFSETS_KEY,
                                                        _HFStorageInfo)
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       StorageMeta, TensorProperties, TensorStorageMetadata)
    sd_md: dict = {}
    storage: dict = {}
    for file in files:
        _, head = header(file)
        extra = head.pop("__metadata__", None) or {}
        sharding = json.loads(extra[CUSTOM_METADATA_KEY]) if extra.get(CUSTOM_METADATA_KEY) else None
        for key, meta in head.items():
            shape = list(meta["shape"])
            offset = list(sharding[key][SAVED_OFFSETS_KEY]) if sharding is not None else [0] * len(shape)
            dtype = DTYPES.get(meta["dtype"]) or _getdtype(meta["dtype"])
            chunk = ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(shape))
            if key not in sd_md:
                sd_md[key] = TensorStorageMetadata(properties=TensorProperties(dtype=dtype),
                                                   size=torch.Size([a + o for a, o in zip(shape, offset)]),
                                                   chunks=[chunk])
            else:
                sd_md[key].chunks.append(chunk)
                sd_md[key].size = torch.Size([max(a, b + o) for a, b, o in zip(sd_md[key].size, shape, offset)])
            storage[MetadataIndex(fqn=key, offset=offset)] = _HFStorageInfo(
                relative_path=file, shape=torch.Size(shape), dtype=dtype)
    md = Metadata(state_dict_metadata=sd_md, storage_data=storage)
    md.storage_meta = StorageMeta()
    md.storage_meta.load_id = load_id
    return md


def reader(path: str, files: list[str]):
    """torch's `HuggingFaceStorageReader` over `files` only, reading into targets directly
    ([Note: reads straight into the shard])."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.futures import Future

    class Listing:
        def __init__(self, fs):
            self._fs = fs

        def ls(self, p):
            return list(files)

        def __getattr__(self, name):
            return getattr(self._fs, name)

    class Reader(HuggingFaceStorageReader):
        def read_metadata(self):
            return metadata(files, self.load_id)

        def read_data(self, plan, planner):
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for file, items in per_file.items():
                base, head = header(file)
                slow = []
                with open(file, "rb", buffering=0) as f:
                    for item in items:
                        meta = head[item.storage_index.fqn]
                        dtype = DTYPES.get(meta["dtype"])
                        run = file_range(meta["shape"], item.storage_offsets, item.lengths)
                        target = planner.resolve_tensor(item).detach()
                        if dtype is None or run is None or target.numel() != run[1] or not target.is_contiguous():
                            slow.append(item)
                            continue
                        read_box(f, base + meta["data_offsets"][0], dtype, run[0], run[1], target)
                        planner.commit_tensor(item, target)
                if slow:                        # torch's own path ([Note: reads straight into the shard])
                    from safetensors import safe_open
                    with safe_open(filename=file, framework="pt") as f:
                        for item in slow:
                            self._process_read_request(f, item, planner)
            fut: Future = Future()
            fut.set_result(None)
            return fut

    where = path if os.path.isdir(path) else os.path.dirname(path) or "."
    r = Reader(where)
    r.fs = Listing(r.fs)
    return r
