"""Bad checkpoints in one sentence — stage: runtime (state).

Input: a load about to run (the checkpoint's metadata beside the state dict it fills) or
one that failed (torch's `CheckpointException`, which carries every rank's traceback).
Output: a `CheckpointError` (a `ShardcError`) naming the tensor, the checkpoint (and its
file, where known), the saved and the expected shape, and what to do; raised alike on
every rank, since every rank reads the same metadata.

[Note: nothing half-loaded]
Every check a load can make runs before the first byte is written. torch's recipe
(`dcp.load(sm.state_dict())`, then `sm.load_state_dict` / `set_state_dict`) fills views of
the shards themselves (runtime/state/checkpoint.py [Note: the recipe loads in place]), as
FSDP2's `dcp.load` fills its sharded parameters; DCP checks every key and shape on every
rank while it plans (its "plan" step: a missing key, a shape mismatch), before any read, so
such a failure leaves the module with the values it had, and usable. A failure while DCP
reads (its "read" step: a truncated or corrupt file, an I/O error) comes after some pieces
were written, in shardc as in FSDP2 (which neither detects nor undoes it): the sentence says
so, and `checkpoint_errors(where, model=sm)` also marks every parameter of `sm` as without
values, so a forward or a step is one sentence until a load succeeds.
`shardc.load_safetensors` reads into the shards too (checkpoint.py [Note: loads in place]),
with every check it can make first, from the files' headers (names, shapes, dtypes); a
failure after the first byte was written marks every parameter the same way.

`checkpoint_errors(where)` is the same conversion for torch's own recipe, where the caller
runs `dcp.load` itself:

    with shardc.checkpoint_errors(path, model=sm):
        dcp.load(state, checkpoint_id=path)
"""
from __future__ import annotations

import contextlib
import re

from shardc.dsl.errors import ShardcError


class CheckpointError(ShardcError):
    """A checkpoint that does not fit the model: one sentence, the module unchanged."""


def _shape(s) -> str:
    return "(" + ", ".join(str(int(d)) for d in s) + ")"


def mismatch(name: str, saved, expected, where: str, file: str | None = None) -> CheckpointError:
    """The sentence for a tensor whose saved shape is not the model's."""
    dims = [i for i, (a, b) in enumerate(zip(saved, expected)) if a != b]
    what = (f"dimension {dims[0]} is {int(saved[dims[0]])} there and {int(expected[dims[0]])} here"
            if len(saved) == len(expected) and dims else f"{len(saved)} dimensions there, {len(expected)} here")
    src = f"{where} ({file})" if file else where
    return CheckpointError(
        f"{src} holds {name} with shape {_shape(saved)}, but the model's {name} is {_shape(expected)} "
        f"({what}); nothing was loaded and the model keeps its values: build the model with the checkpoint's "
        f"configuration (shapes are global, so a checkpoint of any strategy or world size loads as it is)")


def check_shapes(metadata, state_dict: dict, where: str, files: dict[str, str] | None = None) -> None:
    """Refuse, before any byte is read, an entry whose saved shape is not the one the state
    dict expects (`metadata`: DCP's `Metadata`; `files`: tensor -> file, where known)."""
    md = metadata.state_dict_metadata
    for name, value in state_dict.items():
        saved = getattr(md.get(name), "size", None)
        shape = getattr(value, "shape", None)
        if saved is not None and shape is not None and tuple(saved) != tuple(shape):
            raise mismatch(name, tuple(saved), tuple(shape), where, (files or {}).get(name))


_SIZE = re.compile(r"Size mismatch between saved torch\.Size\((\[[^\]]*\])\) and current: "
                   r"torch\.Size\((\[[^\]]*\])\) for (\S+)")
_MISSING = re.compile(r"Missing key in checkpoint state_dict: (\S+?)\.?$")


def from_failure(exc: BaseException, where: str) -> CheckpointError:
    """One sentence for a failed `dcp.load` (a `CheckpointException`: each failing rank's
    exception and traceback), naming the first failure."""
    failures = getattr(exc, "failures", None) or {}
    rank, first = next(iter(sorted(failures.items())), (None, (exc,)))
    err = first[0] if isinstance(first, tuple) else first
    msg = " ".join(str(err).split())
    m = _SIZE.search(msg)
    if m:
        saved, expected = (tuple(int(d) for d in re.findall(r"\d+", g)) for g in m.group(1, 2))
        return mismatch(m.group(3), saved, expected, where)
    m = _MISSING.search(msg)
    if m:
        return CheckpointError(
            f"{where} has no entry {m.group(1)!r}, which the state dict being loaded asks for; nothing was "
            f"loaded and the model keeps its values (a checkpoint of another model, or saved under other "
            f"keys: load with the same get_state_dict layout it was saved with)")
    on = "" if rank is None else f" on rank {rank}"
    tail = PARTWAY if read_step(exc) else NOTHING
    return CheckpointError(f"loading {where} failed{on}: {type(err).__name__}: {msg}{tail}")


NOTHING = "; nothing was loaded and the model keeps its values"
PARTWAY = ("; the load failed part-way (while DCP read the files, after some pieces were written into the "
           "shards, as FSDP2's dcp.load writes its parameters), so the model's values are a mix until a load succeeds")


def read_step(exc: BaseException) -> bool:
    """Whether DCP failed in its read step (after writes), not while planning (before any)."""
    args = getattr(exc, "args", ())
    return bool(args) and args[0] == "read"


def stem(msg: str) -> str:
    """A sentence without its tail about what was loaded."""
    return msg.split(NOTHING)[0].split(PARTWAY)[0]


@contextlib.contextmanager
def checkpoint_errors(where, model=None):
    """Around a `dcp.load` the caller runs: its `CheckpointException` becomes one sentence
    (see the module note); any other exception passes unchanged. `model` (a ShardedModule):
    a failure while reading marks its parameters as without values."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        yield
    except CheckpointException as e:
        if model is not None and read_step(e):
            params = model.state_view.params
            params.expect_values(params.params)
        raise from_failure(e, str(where)) from None


_KEYS = re.compile(r'"([^"]+)"')


def missing_keys(exc: BaseException, where: str) -> CheckpointError | None:
    """torch's strict-load error for keys a checkpoint lacks, as one sentence naming the
    first (None: another error)."""
    msg = str(exc)
    part = msg.split("Missing key(s) in state_dict:", 1)
    if len(part) < 2:
        return None
    keys = _KEYS.findall(part[1].split("Unexpected key(s)", 1)[0])
    return missing(keys, where) if keys else None


def missing(keys: list[str], where: str) -> CheckpointError:
    """The sentence for tensors the model needs and the checkpoint lacks (the first named)."""
    more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
    return CheckpointError(f"{where} has no tensor {keys[0]!r}{more}, which the model needs; nothing was loaded "
                           f"and the model keeps its values (a checkpoint of another model class or "
                           f"configuration?)")
