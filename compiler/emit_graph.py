"""Graph to Python lines — the part of codegen that prints an fx graph (fx capture only).

Input: a scheduled GraphModule (fx capture) and a comment function. Output: the emitted
forward's parameter list, its body lines (code, comment) and the modules to import.

[Note: what the emitted forward looks like]
`self` is the wrapped model (`sm.module`), `rt` its runtime. Root-unit code is the
traced code verbatim (`transformer_wte = self.transformer.wte(idx)`); marker nodes
become `rt.issue_gather(1)` etc.; a unit call becomes
`h_0 = rt.run_unit(1, getattr(self.transformer.h, "0"), add)`. Operators print as
Python operators; every other function by its importable qualified name.
"""
from __future__ import annotations

import builtins
import keyword
import math
import operator
from dataclasses import dataclass

import torch
from torch.fx.node import Node, _get_qualified_name

from shardc.compiler.passes.meta import Call, info
from shardc.dsl.errors import ShardcError

__all__ = ["Line", "GraphCode", "graph_code"]

RESERVED = {"sm", "rt", "self", "torch", "operator", "math", "builtins", "ShardcError"}

_BINARY = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
           operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
           operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.lshift: "<<",
           operator.rshift: ">>", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
           operator.le: "<=", operator.gt: ">", operator.ge: ">="}
_UNARY = {operator.neg: "-", operator.pos: "+", operator.invert: "~", operator.not_: "not "}


@dataclass(frozen=True, slots=True)
class Line:
    code: str
    comment: str = ""


@dataclass(frozen=True, slots=True)
class GraphCode:
    params: tuple[str, ...]          # forward parameters after `sm`
    lines: tuple[Line, ...]
    imports: tuple[str, ...]         # top-level modules the body needs


def module_expr(path: str, base: str = "self") -> str:
    expr = base
    for part in path.split(".") if path else ():
        expr = f"{expr}.{part}" if part.isidentifier() and not keyword.iskeyword(part) else f'getattr({expr}, "{part}")'
    return expr


class _Raw(str):
    """An already-printed expression passed through `arg` unchanged."""


class _Printer:
    def __init__(self, gm):
        self.gm = gm
        self.names: dict[Node, str] = {}
        self.imports: set[str] = set()
        used = {n.name for n in gm.graph.nodes}
        for n in gm.graph.nodes:
            name = n.name
            while name in RESERVED or (name != n.name and name in used):
                name = f"{name}_"
            self.names[n] = name

    def arg(self, a) -> str:
        if isinstance(a, _Raw):
            return str(a)
        if isinstance(a, Node):
            return self.names[a]
        if isinstance(a, tuple):
            return "(" + ", ".join(self.arg(x) for x in a) + ("," if len(a) == 1 else "") + ")"
        if isinstance(a, list):
            return "[" + ", ".join(self.arg(x) for x in a) + "]"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{self.arg(k)}: {self.arg(v)}" for k, v in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({self.arg(a.start)}, {self.arg(a.stop)}, {self.arg(a.step)})"
        if isinstance(a, float) and (math.isinf(a) or math.isnan(a)):
            return f'float("{a}")'
        if isinstance(a, (torch.dtype, torch.layout, torch.memory_format)):
            self.imports.add("torch")
            return str(a)
        if isinstance(a, torch.device):
            self.imports.add("torch")
            return f'torch.device("{a}")'
        if a is None or a is Ellipsis or isinstance(a, (bool, int, float, str)):
            return repr(a)
        raise ShardcError(f"cannot emit a constant of type {type(a).__name__} ({a!r}) into generated code")

    def call(self, fn: str, args, kwargs) -> str:
        parts = [self.arg(a) for a in args] + [f"{k}={self.arg(v)}" for k, v in kwargs.items()]
        return f"{fn}({', '.join(parts)})"

    def function(self, target) -> str:
        if getattr(builtins, getattr(target, "__name__", ""), None) is target:
            return target.__name__
        name = _get_qualified_name(target)
        top = name.split(".")[0]
        if top.startswith("_shardc_model_") or top == "__main__":
            raise ShardcError(f"function {name} lives in a module the generated code cannot import; "
                              "move it into an importable module or inside a unit")
        self.imports.add(top)
        return name

    def call_function(self, n: Node) -> str:
        t, args = n.target, n.args
        if t in _BINARY and len(args) == 2 and not n.kwargs:
            return f"{self.arg(args[0])} {_BINARY[t]} {self.arg(args[1])}"
        if t in _UNARY and len(args) == 1:
            return f"{_UNARY[t]}{self.arg(args[0])}"
        if t is operator.getitem and len(args) == 2:
            return f"{self.arg(args[0])}[{self.arg(args[1])}]"
        if t is builtins.getattr and len(args) == 2 and isinstance(args[1], str) and args[1].isidentifier():
            return f"{self.arg(args[0])}.{args[1]}"
        return self.call(self.function(t), args, n.kwargs)


def graph_code(gm, comment) -> GraphCode:
    """The forward of a scheduled fx-capture graph as Python lines; `comment(node) -> str`.

    A unit of k modules (a bucket) is k `rt.run_unit(i, ...)` calls: the runtime gathers
    it on the first and releases it after the k-th; the gather markers precede the first.
    """
    pr = _Printer(gm)
    params, lines = [], []
    for n in gm.graph.nodes:
        name, meta = pr.names[n], info(n)
        op = meta.op if meta is not None else Call.COMPUTE
        if n.op == "placeholder":
            if str(n.target).startswith("*"):
                raise ShardcError("forward(*args, **kwargs) cannot be emitted; give the model explicit arguments")
            params.append(name if not n.args else f"{name}={pr.arg(n.args[0])}")
            continue
        if n.op == "output":
            lines.append(Line(f"return {pr.arg(n.args[0])}"))
            continue
        code = _node_code(pr, n, op, meta)
        lines.append(Line(f"{name} = {code}" if n.users else code, comment(n)))
    return GraphCode(tuple(params), tuple(lines), tuple(sorted(pr.imports)))


def _node_code(pr: _Printer, n: Node, op: Call, meta) -> str:
    if op in (Call.BEGIN_FORWARD, Call.ISSUE_GATHER, Call.WAIT_GATHER, Call.RELEASE, Call.END_FORWARD):
        return pr.call(f"rt.{op.value}", n.args, n.kwargs)
    if op is Call.RUN_UNIT:
        return pr.call("rt.run_unit", (meta.unit, _Raw(module_expr(n.target)), *n.args), n.kwargs)
    if n.op == "call_module":
        return pr.call(module_expr(n.target), n.args, n.kwargs)
    if n.op == "get_attr":
        return module_expr(n.target)
    if n.op == "call_method":
        return pr.call(f"{pr.arg(n.args[0])}.{n.target}", n.args[1:], n.kwargs)
    if n.op == "call_function":
        return pr.call_function(n)
    raise ShardcError(f"cannot emit graph node {n.format_node()}")
