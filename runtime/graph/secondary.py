"""The secondary params copy (hpZ) in the whole-step mode — stage: runtime (`backend="inductor"`).

Input: a unit's gathered full buffer inside its checkpoint region (graph/step.py), the
group's plan rows and chunk (`RankPlan.secondary_chunk`), the functional collectives
(graph/funcol.py). Output: two custom ops the region calls — `shardc::keep_secondary` (this
rank's Q chunk of the full buffer, quantized when the strategy says) and
`shardc::regather` (the full buffer again, from that chunk) — and `resolve_secondary`,
the pass graph/backend.py runs on each compiled graph before the schedule pass.

[Note: a re-gather that is not a recomputation]
The eager runtime keeps the secondary copy after the forward gather and re-gathers the
backward's parameters from it over Q (the backward re-gather row). AOTAutograd can only
recompute in the backward what the forward computed, so the region says it with two ops:
`keep_secondary` (`MUST_SAVE`: the chunk is what the backward keeps) and `regather(full,
codes, scales)`, which the forward uses as its parameters (`MUST_RECOMPUTE`: the
partitioner puts a copy in the backward, with the forward's gather chain before it). In
the forward graph `resolve_secondary` replaces `regather` by its input (no copy); in the
backward graph it replaces it by the Q gather of the saved chunk (graph/funcol.py, traced with
`make_fx`: the row's algorithm and codec), tagged with the unit so the schedule pass
places it, and erases the recomputed forward gather it no longer needs. So the forward
issues the P gather, the backward the Q gather: the plan's two rows, and nothing else.
The chunk lives from the forward to the backward as a saved tensor of the graph, so the
persistent secondary buffer of the eager runtime is not allocated in this mode.
"""
from __future__ import annotations

from math import ceil

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardc.lowering import BLOCK, code_bytes

from ..transport import quant
from .quant_ops import BITS

_OPS = torch.ops.shardc


@torch.library.custom_op("shardc::keep_secondary", mutates_args=())
def keep_secondary(full: torch.Tensor, start: int, length: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's secondary chunk of `full`: (codes, fp32 block scales) when `bits`, else
    (the chunk's values, an empty scales tensor)."""
    mine = full[start:start + length]
    if bits:
        codes, scales = quant.encode(mine, BITS[bits])
        return codes.clone(), scales.clone()
    return mine.clone(), full.new_empty(0, dtype=torch.float32)


@keep_secondary.register_fake
def _(full, start, length, bits):
    if bits:
        dtype = torch.int8 if bits == 8 else torch.uint8
        return (full.new_empty(code_bytes(length, BITS[bits]), dtype=dtype),
                full.new_empty(ceil(length / BLOCK), dtype=torch.float32))
    return full.new_empty(length), full.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("shardc::regather", mutates_args=())
def regather(full: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, key: int) -> torch.Tensor:
    """The full buffer: `full` itself. Its backward copy is the Q gather of (codes,
    scales), put in place by `resolve_secondary` ([Note: a re-gather that is not a recomputation])."""
    return full.clone()


@regather.register_fake
def _(full, codes, scales, key):
    return torch.empty_like(full)


def _regather_backward(ctx, grad):
    return grad, None, None, None


regather.register_autograd(_regather_backward)

SAVE = frozenset({_OPS.keep_secondary.default})
RECOMPUTE = frozenset({_OPS.regather.default})


class Secondaries:
    """Every hpZ group's backward gather, by the key its `regather` carries."""

    def __init__(self, comm):
        self.comm = comm
        self.rows: dict[int, tuple] = {}

    def add(self, row, m: int, bits: int, dtype: torch.dtype) -> int:
        """A group's Q row (None: Q is one rank), chunk length, codec bits; its key."""
        self.rows[len(self.rows)] = (row, m, bits, dtype)
        return len(self.rows) - 1

    def gather(self, key: int, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The full buffer from the saved chunk: the backward re-gather row over Q."""
        row, m, bits, dtype = self.rows[key]
        if bits:
            return self.comm.all_gather_encoded(row, codes, scales, m, bits).to(dtype)
        return self.comm.all_gather(row, codes)


def resolve_secondary(graph, backward: bool, secondaries: Secondaries | None, tag: str) -> None:
    """[Note: a re-gather that is not a recomputation] on one compiled graph."""
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is _OPS.regather.default]:
        full, codes, scales, key = node.args
        if not backward:
            node.replace_all_uses_with(full)
        else:
            with graph.inserting_before(node):
                out = _inline(graph, secondaries, key, codes, scales, (node.meta.get("custom") or {}).get(tag), tag)
            node.replace_all_uses_with(out)
        graph.erase_node(node)
        if backward:
            _erase_dead(graph, full)


def _inline(graph, secondaries, key, codes, scales, unit, tag):
    """The Q gather traced on the saved chunk's fake values, copied in before `regather`."""
    traced = make_fx(lambda c, s: secondaries.gather(key, c, s))(codes.meta["val"], scales.meta["val"])
    inputs = [n for n in traced.graph.nodes if n.op == "placeholder"]
    val_map = {inputs[0]: codes, inputs[1]: scales}
    out = graph.graph_copy(traced.graph, val_map)
    for old, new in val_map.items():
        if old.op == "call_function":
            new.meta.setdefault("custom", {})[tag] = unit
    return out


def _erase_dead(graph, node) -> None:
    """Erase `node` and what only it needed, now that nothing uses them (the forward's
    gather chain the partitioner had copied into the backward)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.op != "call_function" or n.users:
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        todo.extend(inputs)
