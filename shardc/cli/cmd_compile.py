"""`shardc compile FILE --model PATH.py:FACTORY -o OUT.py` — emit a sharded module.

Input: a strategy file, a model factory, capture options. Output: OUT.py, the module
`shardc.compile` would execute, exposing `shard_model(model) -> ShardedModule`.

Example inputs (needed by export capture only): `--example-input int64[2,16]` (one per
positional input, dtype[shape], random values), or else the factory's module may
define `example_inputs()` or `example_inputs(model)` returning a tuple of tensors.
"""
from __future__ import annotations

import inspect
import os
import re
import sys

import torch

from shardc.dsl.errors import ShardcError
from shardc.lowering.passes import parse_passes

_DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "bool": torch.bool}


def add_arguments(p) -> None:
    p.add_argument("file", help="the .shard strategy")
    p.add_argument("--model", required=True, metavar="PATH.py:FACTORY", help="model factory")
    p.add_argument("--capture", choices=("auto", "fx", "export"), default="auto")
    p.add_argument("--mesh", default=None, help='mesh override, e.g. "node(2) > gpu(2)"')
    p.add_argument("--world", type=int, default=None, help="world size (resolves `*` and checks the mesh)")
    p.add_argument("--example-input", action="append", default=None, metavar="SPEC",
                   help="dtype[shape] of one positional input, e.g. int64[2,16] (repeat per input)")
    p.add_argument("--passes", default=None, metavar="NAMES",
                   help='plan passes to run, comma-separated ("" for none; default: all of shardc.lowering.passes)')
    p.add_argument("--inductor", action="store_true",
                   help="the whole-step compiled mode: each micro-batch's forward and backward one Inductor graph, "
                        "collectives included, and the step's sync and update one more (bucket 0)")
    p.add_argument("-o", "--output", required=True, metavar="OUT.py")


def parse_input_spec(spec: str) -> torch.Tensor:
    """`int64[2,16]` -> a deterministic random tensor of that dtype and shape."""
    m = re.fullmatch(r"\s*(\w+)\s*\[\s*([0-9,\s]*)\]\s*", spec)
    if not m or m.group(1) not in _DTYPES:
        raise ShardcError(f"example input {spec!r} must look like DTYPE[D0,D1,...] with DTYPE one of "
                          f"{', '.join(sorted(_DTYPES))}")
    shape = tuple(int(d) for d in m.group(2).replace(" ", "").split(",") if d)
    dtype, g = _DTYPES[m.group(1)], torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 2, shape, generator=g, dtype=dtype)


def _example_inputs(args, model):
    if args.example_input:
        return tuple(parse_input_spec(s) for s in args.example_input)
    from shardc.cli.loader import load_module
    fn = getattr(load_module(args.model), "example_inputs", None)
    if fn is None:
        return None
    try:
        out = fn(model) if inspect.signature(fn).parameters else fn()
    except Exception as e:  # noqa: BLE001
        raise ShardcError(f"example_inputs() in {args.model.rpartition(':')[0]} raised {type(e).__name__}: {e}") from e
    return out if isinstance(out, tuple) else (out,)


def run(args) -> int:
    from shardc.compiler.api import compile_source
    from shardc.cli.loader import build_model

    if not os.path.isfile(args.file):
        raise ShardcError(f"strategy file {args.file!r} not found")
    model = build_model(args.model)
    inputs = _example_inputs(args, model) if args.capture != "fx" else None
    source, plan = compile_source(model, args.file, inputs, args.capture, args.mesh, args.world,
                                  passes=parse_passes(args.passes), backend="inductor" if args.inductor else "eager")
    for warning in plan.strategy.warnings:
        print(warning, file=sys.stderr)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(source)
    except OSError as e:
        raise ShardcError(f"cannot write {args.output}: {e.strerror or e}") from None
    print(f"wrote {args.output}: strategy {plan.strategy.name} on {plan.strategy.mesh}, "
          f"{len(plan.units)} units, capture {plan.capture}")
    return 0
