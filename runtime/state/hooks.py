"""The model's own state-dict machinery — stage: runtime (state).

Input: the original model (whose parameters shardc removed from its modules), where each
parameter was registered (`targets`: canonical name -> [(module, attr)]) and a value per
parameter. Output: `save` — the dict `nn.Module.state_dict()` gives with those values in
place, the model's state-dict hooks, pre-hooks and `get_extra_state` run as torch runs
them; `load` — the value each parameter and buffer receives from `nn.Module.load_state_dict`,
the model's load pre- and post-hooks and `set_extra_state` run as torch runs them.

[Note: torch runs the model's hooks]
A model's state-dict keys need not be its parameter names: torchtitan's fused QKV saves
its one `wqkv` as `wq`, `wk`, `wv` and fuses them back in a load pre-hook; HF models,
peft and quantization wrappers register such hooks too. So shardc never builds a state
dict by name: it puts a value in each module's `_parameters` for the duration of one
`sm.module.state_dict(keep_vars=True)` call (and as the attribute, for a hook that reads
`module.weight`), and torch does the rest. A hook that only renames or moves an entry
hands back the tensor it was given; one that computes a new tensor (a split, a cast)
needs whole values. `save` finds out which with a probe run on meta tensors: a parameter
whose probe is not among the values handed back, and every parameter under the module
owning a computed entry, is given as the whole tensor (gathered), the others as this
rank's piece. Loading is torch's `load_state_dict(assign=True)` with a meta receiver
registered as a buffer at each parameter and persistent buffer: torch checks names and
shapes, runs the hooks, and assigns each receiver its value, which `load` hands back
without having changed anything live.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn


@contextlib.contextmanager
def _registered(targets: dict[str, list], values: dict[str, torch.Tensor]):
    """Each parameter's value in `_parameters` (and as the attribute) at every place it is
    registered, for the duration of the block; everything restored after."""
    saved = []
    try:
        for name, places in targets.items():
            for mod, attr in places:
                saved.append((mod, attr, mod.__dict__.get(attr, _MISSING)))
                mod._parameters[attr] = values[name]
                mod.__dict__[attr] = values[name]
        yield
    finally:
        for mod, attr, old in reversed(saved):
            mod._parameters.pop(attr, None)
            if old is _MISSING:
                mod.__dict__.pop(attr, None)
            else:
                mod.__dict__[attr] = old


_MISSING = object()


def _state_dict(model: nn.Module, targets, values) -> dict:
    with _registered(targets, values), torch.no_grad():
        return model.state_dict(keep_vars=True)


def whole_needed(model: nn.Module, targets: dict[str, list], shapes: dict[str, tuple]) -> set[str]:
    """The parameters the model's save hooks compute from (see [Note: torch runs the
    model's hooks]); every parameter when the probe itself fails."""
    return _probe(model, targets, shapes)[0]


def renamed(model: nn.Module, targets: dict[str, list], shapes: dict[str, tuple]) -> set[str]:
    """The parameters the model's save hooks do not hand back under their own name."""
    return _probe(model, targets, shapes)[1]


def saved_keys(model: nn.Module, targets: dict[str, list], shapes: dict[str, tuple]) -> list[str]:
    """The keys the model's `state_dict()` gives (hooks run on meta probes)."""
    return list(saved_probes(model, targets, shapes))


def saved_probes(model: nn.Module, targets: dict[str, list], shapes: dict[str, tuple]) -> dict:
    """The model's `state_dict()` with meta tensors for the parameters (names and shapes,
    no values: what a load checks against without copying anything)."""
    probes = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    return _state_dict(model, targets, probes)


def _probe(model, targets, shapes) -> tuple[set[str], set[str]]:
    probes = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
    try:
        sd = _state_dict(model, targets, probes)
    except Exception:                                   # noqa: BLE001 — a hook meta cannot run
        return set(targets), set(targets)
    given = {id(t) for t in probes.values()} | {id(b) for b in model.buffers()}
    handed = {id(v) for v in sd.values() if isinstance(v, torch.Tensor)}
    need = {n for n, t in probes.items() if id(t) not in handed}
    kept = {n for n, t in probes.items() if sd.get(n) is t}
    owners = {_owner(model, k) for k, v in sd.items() if isinstance(v, torch.Tensor) and id(v) not in given}
    if owners:
        paths: dict[int, str] = {}
        for name, m in model.named_modules(remove_duplicate=False):
            paths.setdefault(id(m), name)
        need |= {n for n, places in targets.items()
                 if any(_under(paths[id(mod)], o) for mod, _ in places for o in owners)}
    return need, set(probes) - kept


def hook_owner(model: nn.Module, name: str) -> tuple[str, nn.Module]:
    """(path, module) of the deepest module above parameter `name` with state-dict hooks
    of its own (the parameter's module when none has)."""
    parts = name.split(".")[:-1]
    for k in range(len(parts), -1, -1):
        path = ".".join(parts[:k])
        mod = model.get_submodule(path)
        if mod._state_dict_hooks or mod._state_dict_pre_hooks or mod._load_state_dict_pre_hooks:
            return path, mod
    path = ".".join(parts)
    return path, model.get_submodule(path)


def _under(path: str, owner: str) -> bool:
    return not owner or path == owner or path.startswith(owner + ".")


def _owner(model: nn.Module, key: str) -> str:
    """The deepest module path that prefixes `key` (its hook computed the entry)."""
    parts = key.split(".")
    for k in range(len(parts) - 1, -1, -1):
        prefix = ".".join(parts[:k])
        try:
            model.get_submodule(prefix)
            return prefix
        except AttributeError:
            continue
    return ""


def save(model: nn.Module, targets: dict[str, list], values: dict[str, torch.Tensor]) -> dict:
    """`model.state_dict()` with `values` as the parameters; buffers copied out."""
    sd = _state_dict(model, targets, values)
    live = {id(b) for b in model.buffers()}
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) and id(v) in live else v
            for k, v in sd.items()}


def load(model: nn.Module, targets: dict[str, list], shapes: dict[str, tuple], sd, strict: bool):
    """torch's `model.load_state_dict(sd, strict, assign=True)` into meta receivers (see
    the module notes). Returns (values per parameter name, values per buffer place
    [(module, attr, value)], torch's `_IncompatibleKeys`). Nothing live changes."""
    receivers, slots = {}, []
    for name, places in targets.items():
        for mod, attr in places:
            r = torch.empty(shapes[name], device="meta")
            receivers[(id(mod), attr)] = r
            slots.append((mod, attr, name, r, False))
    for mod in model.modules():
        for attr, buf in list(mod._buffers.items()):
            if buf is not None and attr not in mod._non_persistent_buffers_set:
                r = torch.empty(buf.shape, dtype=buf.dtype, device="meta")
                slots.append((mod, attr, None, r, buf))
    try:
        for mod, attr, name, r, buf in slots:
            mod._buffers[attr] = r
        result = model.load_state_dict(sd, strict=strict, assign=True)
        params, bufs = {}, []
        for mod, attr, name, r, buf in slots:
            got = mod._buffers.get(attr)
            if got is r:
                continue
            if name is not None:
                params.setdefault(name, got)
            else:
                bufs.append((buf, got))
        return params, bufs, result
    finally:
        for mod, attr, name, r, buf in slots:
            if name is not None:
                mod._buffers.pop(attr, None)
            else:
                mod._buffers[attr] = buf


class AnyKey:
    """What torch's state-dict helpers walk a key through (see `KeyModifiers`): every
    attribute is another AnyKey."""

    def __getattr__(self, name: str) -> "AnyKey":
        if name.startswith("__") or name == "_fqn_modifiers":
            raise AttributeError(name)
        return self


class KeyModifiers(dict):
    """`ShardedModule._fqn_modifiers()`: torch.distributed.checkpoint.state_dict's protocol
    for a wrapper's prefix. `values()` says the wrapped model is `.module` (so torch's
    traversal skips that prefix); `get(atom)` sends the name check of a state-dict key
    (`_get_fqns`, which reads each key as a chain of module attributes) to an `AnyKey`,
    since a key a model's own hook made (torchtitan's `wq` of a fused `wqkv`) is no
    attribute: the keys are whatever the model's state-dict machinery gave."""

    def get(self, key, default=None):
        return "_shardc_keys"

    def values(self):
        return ["module"]
