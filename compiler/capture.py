"""Capture — compiler stage `capture` (model -> torch.fx graph with unit regions).

Input: an `nn.Module`, its unit table (`find_units`), optional example inputs, a mode.
Output: a `torch.fx.GraphModule` whose `meta["shardc"]` is a `CaptureInfo` (mode, the
unit table reordered into forward execution order, the model's parameter names, notes).

[Note: two capture modes]
`fx`: `torch.fx` symbolic trace in which every unit module is a leaf, so each unit is
one `call_module` node and the rest of the graph is the root unit's code; readable, and
what codegen turns into the emitted forward. `export`: `torch.export.export(...,
strict=False)` on the example inputs (aten-level graph); each node's unit is the
outermost unit module on its `nn_module_stack`, so a unit is a region of nodes. Used
for models with Python control flow (Hugging Face transformers). `auto` tries fx, then
export (with a note). A failed capture raises one ShardcError naming the module and
source line that stopped it and what to try (both reasons when both modes fail), never
a torch traceback. Example inputs are checked against the model in every mode.

[Note: outputs as they come]
Export only analyses the forward (the runtime runs the model's own code), so it traces
a forward that returns the tensors of the output: a `ModelOutput` with a loss from
`labels=` and a `DynamicCache` (`use_cache=True`, Hugging Face's default) need no
setting changed; containers torch cannot flatten are left out of the traced output.
"""
from __future__ import annotations

import contextlib
import inspect
import io
import re
import logging
import os
import traceback
import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from shardc.compiler.reuse import reused_blocks
from shardc.dsl.errors import ShardcError
from shardc.units import param_owners, reorder

__all__ = ["CaptureInfo", "capture", "MODES"]

MODES = ("auto", "fx", "export")
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True, slots=True)
class CaptureInfo:
    mode: str                    # "fx" | "export"
    units: tuple                 # UnitSpec, root first, forward execution order
    params: tuple[str, ...]      # the model's canonical parameter FQNs, registration order
    notes: tuple[str, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()   # (tied alias, canonical name)
    reused: int = 0              # unit modules whose capture reused an identical block's (compiler/reuse.py)

    @property
    def canonical(self) -> dict[str, str]:
        """Every FQN a parameter of the model is reachable under -> its canonical name."""
        return {**{p: p for p in self.params}, **dict(self.aliases)}


class _UnitTracer(fx.Tracer):
    """Symbolic tracer that keeps unit modules opaque and remembers where it is."""

    def __init__(self, leaves: set[str]):
        super().__init__()
        self.leaves = leaves
        self.stack: list[tuple[str, nn.Module]] = []

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return qualname in self.leaves or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self.stack.append((self.path_of_module(m), m))
        out = super().call_module(m, forward, args, kwargs)
        self.stack.pop()
        return out


def _user_frame(exc: BaseException):
    """The innermost traceback frame outside torch (the user's line), or None."""
    frames = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
    user = [f for f in frames if not f.f_code.co_filename.startswith("<")
            and not os.path.abspath(f.f_code.co_filename).startswith((_TORCH_DIR, _HERE))]
    return user[-1] if user else None


def _module_at(model: nn.Module, frame) -> str | None:
    owner = frame.f_locals.get("self") if frame is not None else None
    if isinstance(owner, nn.Module):
        for fqn, m in model.named_modules():
            if m is owner:
                return fqn or "<root>"
    return None


def _located(model: nn.Module, what: str, exc: BaseException, fallback_module: str | None = None) -> str:
    """`<what> stopped in module 'm' at file:line (`code`): Error: first line`."""
    frame = _user_frame(exc)
    module = _module_at(model, frame) or fallback_module or "<root>"
    where = ""
    if frame is not None:
        import linecache
        path = frame.f_code.co_filename
        if not path.startswith("<") and not os.path.relpath(path).startswith(".."):
            path = os.path.relpath(path)
        code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        where = f" at {path}:{frame.f_lineno}" + (f" (`{code}`)" if code else "")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{what} stopped in module '{module}'{where}: {type(exc).__name__}: {first}"


def _leaves(units) -> set[str]:
    return {m for u in units[1:] for m in u.modules}


def _capture_fx(model: nn.Module, units) -> fx.GraphModule:
    tracer = _UnitTracer(_leaves(units))
    try:
        graph = tracer.trace(model)
    except Exception as e:  # noqa: BLE001 — reported as a located ShardcError
        inner = tracer.stack[-1][0] if tracer.stack else None
        raise ShardcError(_located(model, "capture fx", e, inner) + "; try `capture export` with example inputs, "
                          "or list that module in `units` so its code runs inside a leaf unit") from None
    gm = fx.GraphModule(model, graph, class_name=type(model).__name__)
    leaves = _leaves(units)
    first_run = [n.target for n in graph.nodes if n.op == "call_module" and n.target in leaves]
    gm.meta["shardc"] = _info("fx", model, units, first_run)
    return gm


def _info(mode: str, model: nn.Module, units, first_run: list[str]) -> CaptureInfo:
    """The capture's record: units in the order their modules first run, the model's names."""
    owners = param_owners(model).values()
    return CaptureInfo(mode, tuple(reorder(list(units), _dedup(first_run))), tuple(names[0] for names in owners),
                       aliases=tuple((a, names[0]) for names in owners for a in names[1:]))


def _dedup(xs):
    return list(dict.fromkeys(xs))


def unit_of_stack(stack: dict | None, leaves: set[str]) -> str | None:
    """The outermost unit module on an `nn_module_stack` (None: the root unit)."""
    for path, _ in (stack or {}).values():
        if path in leaves:
            return path
    return None


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch.export logs every failed guard with the whole graph; the ShardcError says enough.
    Only `torch` and the torch loggers with a level of their own are set (the others inherit
    it): each `setLevel` clears every logger's cache, and setting all ~480 of them cost
    0.25 s per capture. Nodes get no stack traces (`torch.fx.config.do_not_emit_stack_traces`):
    nothing reads them, and extracting one per node cost 0.6 s on an 80-layer Llama."""
    manager = logging.root.manager.loggerDict
    loggers = [logging.getLogger("torch")] + [
        lg for n, lg in list(manager.items())
        if n.startswith("torch.") and isinstance(lg, logging.Logger) and lg.level != logging.NOTSET]
    levels = [lg.level for lg in loggers]
    traces = torch.fx.config.do_not_emit_stack_traces
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = traces
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _tensor_leaves(out) -> tuple:
    """The tensors of a forward's output (dicts incl. ModelOutput, tuples, lists), in order."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if isinstance(out, dict):
        return tuple(t for v in out.values() for t in _tensor_leaves(v))
    if isinstance(out, (tuple, list)):
        return tuple(t for v in out for t in _tensor_leaves(v))
    return ()


@contextlib.contextmanager
def _tensor_outputs(model: nn.Module):
    """Export a forward that returns the output's tensors (see [Note: outputs as they come])."""
    own = model.__dict__.get("forward")
    inner = model.forward
    model.forward = lambda *a, **k: _tensor_leaves(inner(*a, **k))
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def _construct_hint(exc: BaseException) -> str:
    """What to change when torch could not capture a construct it names."""
    m = re.search(r"<class '([\w.]+)'>", str(exc))
    if m and "Cache" in m.group(1):
        return (f"; torch cannot capture the {m.group(1).rsplit('.', 1)[-1]} there: pass no cache "
                f"(or set `use_cache=False` in the model's config)")
    if m:
        return f"; torch cannot capture the {m.group(1).rsplit('.', 1)[-1]} there"
    return ""


def _export_hint(model: nn.Module, units, exc: BaseException) -> str:
    module = _module_at(model, _user_frame(exc))
    leaves = _leaves(units)
    inside = module is not None and any(module == u or module.startswith(u + ".") for u in leaves)
    if inside:
        return (f"; that code is inside unit '{next(u for u in leaves if module == u or module.startswith(u + '.'))}', "
                f"so make it traceable for these example inputs (or try `capture fx`)")
    return "; move that code into a unit listed in `units`, or make it traceable for these example inputs"


def _capture_export(model: nn.Module, units, example_inputs, reuse: bool = True) -> fx.GraphModule:
    if example_inputs is None:
        raise ShardcError("capture export needs example inputs (pass example_inputs=..., or --example-input)")
    args = _as_args(example_inputs)
    try:
        with _quiet_torch_logs(), _tensor_outputs(model), reused_blocks(model, _leaves(units), reuse) as reused:
            ep = torch.export.export(model, args, strict=False)
    except Exception as e:  # noqa: BLE001
        raise ShardcError(_located(model, "capture export", e) + (_construct_hint(e) or _export_hint(model, units, e))) from None
    gm = ep.graph_module
    leaves = _leaves(units)
    first_run = []
    for n in gm.graph.nodes:
        unit = unit_of_stack(n.meta.get("nn_module_stack"), leaves)
        if unit is not None:
            first_run.append(unit)
    gm.meta["shardc"] = dataclasses.replace(_info("export", model, units, first_run), reused=reused.count)
    return gm


def _as_args(example_inputs) -> tuple:
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


def check_example_inputs(model: nn.Module, example_inputs, run: bool = True) -> None:
    """Example inputs must fit the model's forward: its signature, then (`run`) one no-grad run."""
    if example_inputs is None:
        return
    args = _as_args(example_inputs)
    name = f"{type(model).__name__}.forward"
    try:
        inspect.signature(model.forward).bind(*args)
    except TypeError as e:
        raise ShardcError(f"the example inputs do not match {name}{inspect.signature(model.forward)}: "
                          f"{e} ({len(args)} given)") from None
    except ValueError:                      # no signature to compare with (a C function)
        pass
    if not run or any(p.is_meta for p in model.parameters()):     # nothing to run on
        return
    try:
        with torch.no_grad(), _quiet_torch_logs():
            model(*args)
    except Exception as e:  # noqa: BLE001 — reported as one located sentence
        raise ShardcError(f"the example inputs do not fit {name}: running them " + _located(model, "", e).lstrip()) from None


_NEEDS_INPUTS = ("{name} needs example inputs: torch.fx cannot trace it, and capturing it with torch.export runs "
                 "it on them, so pass example_inputs=(...) to shardc.compile (--example-input to `shardc compile`)")


def capture(model: nn.Module, units, example_inputs=None, mode: str = "auto", reuse: bool = True) -> fx.GraphModule:
    """Capture `model` as an fx graph with one region per unit (see the module note); `reuse`:
    export traces each distinct block once (compiler/reuse.py [Note: capture once per block])."""
    if mode not in MODES:
        raise ShardcError(f"unknown capture mode {mode!r}; use one of {', '.join(MODES)}")
    check_example_inputs(model, example_inputs, run=mode != "export")   # export runs them itself
    if mode == "fx":
        return _capture_fx(model, units)
    if mode == "export":
        return _capture_export(model, units, example_inputs, reuse)
    try:
        return _capture_fx(model, units)
    except ShardcError as fx_error:
        if example_inputs is None:     # the fix is the sentence, not fx's reason (Hugging Face: co_varnames)
            raise ShardcError(_NEEDS_INPUTS.format(name=type(model).__name__)) from None
        try:
            gm = _capture_export(model, units, example_inputs, reuse)
        except ShardcError as export_error:
            raise ShardcError(f"neither capture mode worked — {fx_error}; and {export_error}") from None
        info = gm.meta["shardc"]
        gm.meta["shardc"] = dataclasses.replace(info, notes=info.notes + (f"fx failed, used export: {fx_error}",))
        return gm
