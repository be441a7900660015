"""Model loading — the front of every model-taking CLI command.

Input: a factory spec `PATH.py:FACTORY` (a file) or `dotted.module:FACTORY`.
Output: the factory (a zero-argument callable returning an `nn.Module`), the model, or
(`load_model_units`) the model built on the meta device with its units sized for the cost model.

Every failure is one `ShardcError` sentence (file not found, no such attribute, not
callable, the factory raised, the factory did not return a module), never a traceback.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Callable

from torch import nn

from shardc.dsl.errors import ShardcError

__all__ = ["load_factory", "build_model", "load_module", "load_model_units"]


def _split(spec: str) -> tuple[str, str]:
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ShardcError(f"model spec {spec!r} must look like PATH.py:FACTORY or dotted.module:FACTORY")
    return where, name


def _import_file(path: str):
    if not os.path.isfile(path):
        raise ShardcError(f"model file {path!r} not found")
    absolute = os.path.abspath(path)
    digest = hashlib.sha1(absolute.encode()).hexdigest()[:10]
    mod_name = f"_shardc_model_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, absolute)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module          # dataclasses and pickling look the module up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 — user code: report, don't trace
        del sys.modules[mod_name]
        raise ShardcError(f"importing {path} raised {type(e).__name__}: {e}") from e
    return module


def _import_dotted(name: str):
    """`name` imported as `python -m` would find it: the working directory first on
    `sys.path` (the `shardc` script's own directory is there instead), so
    `--model examples.gpt:small` works from the repository root."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise ShardcError(f"model module {name!r} not found ({e})") from e
    except Exception as e:  # noqa: BLE001
        raise ShardcError(f"importing {name} raised {type(e).__name__}: {e}") from e


def load_module(spec: str):
    """The Python module named by the part of `spec` before the colon."""
    where, _ = _split(spec)
    if where.endswith(".py") or os.sep in where or "/" in where:
        return _import_file(where)
    return _import_dotted(where)


def load_factory(spec: str) -> Callable[[], nn.Module]:
    """The factory named by `spec` (`PATH.py:FACTORY` or `dotted.module:FACTORY`)."""
    where, name = _split(spec)
    module = load_module(spec)
    if not hasattr(module, name):
        raise ShardcError(f"{where} has no attribute {name!r}")
    factory = getattr(module, name)
    if not callable(factory):
        raise ShardcError(f"{where}:{name} is not callable (it is a {type(factory).__name__})")
    return factory


def build_model(spec: str, device: str | None = None) -> nn.Module:
    """Call the factory named by `spec`; `device="meta"` builds without memory."""
    factory = load_factory(spec)
    try:
        if device is None:
            model = factory()
        else:
            import torch
            with torch.device(device):
                model = factory()
    except ShardcError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ShardcError(f"factory {spec} raised {type(e).__name__}: {e}") from e
    if not isinstance(model, nn.Module):
        raise ShardcError(f"factory {spec} did not return an nn.Module (got {type(model).__name__})")
    return model


def meta_model(spec: str, strategy, tp: int = 1) -> nn.Module:
    """`spec` built on the meta device; with `tp` > 1 cut to one tensor-parallel rank's
    shapes under the plan `--tp` assumes (analysis/costmodel/tp.py)."""
    model = build_model(spec, device="meta")
    if tp > 1:
        from dataclasses import replace

        from shardc.analysis.costmodel.tp import split_for_tp
        from shardc.units import find_units
        split_for_tp(model, find_units(model, replace(strategy, bucket=0)), tp)
    return model


def load_model_units(strategy, spec: str, tp: int = 1):
    """Build `spec` (PATH.py:FACTORY) on the meta device (one tp rank's shapes) and size
    its units (`UnitSize`s)."""
    from shardc.analysis.costmodel import report
    return report.model_units(strategy, meta_model(spec, strategy, tp))
