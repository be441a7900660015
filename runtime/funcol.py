"""Functional collectives — stage: runtime (the whole-step compiled mode's collectives).

Input: a plan `Row` (`shardc.lowering`: levels, chunk digit order, wire dtype), a `ShardMesh`
(its groups) and the algorithm (`Collectives`), and the tensor a row moves.
Output: the result as a new tensor, computed with `torch.distributed._functional_collectives`
only, so dynamo traces it and Inductor compiles it inside the step's graphs (graph_step.py,
graph_boundary.py). The eager runtime's `collectives.py` is the reference: every algorithm
here places chunks exactly as it does (its [Note: chunk placement]), so either runtime
loads the other's state.

[Note: the same algorithms, as graph ops]
RING is one functional collective over the group positioned by the chunk order. A
reduce-scatter stage on a gloo group is an `all_to_all_single` and a sum, as in the
eager runtime (gloo's own reduce-scatter is an all-reduce and a slice: 4/3 of a ring's
bytes at 4 ranks); the choice is made per group when the comm is built, not traced.
HIERARCHICAL is one per level, all-gather outermost level first and reduce-scatter
innermost first, with the same local permutes; HO_RING splits the chunk into
`HO_PIECES` pieces, each its own chain of per-level collectives, so the graph holds the
pieces' stages side by side for Inductor to overlap. int8/int4 all-gathers (qwZ) gather
the quantized payloads (runtime/quant.py) with the row's algorithm and decode every chunk;
int8/int4 reduce-scatters (qgZ) are an `all_to_all_single` of the quantized chunks,
decoded and summed in fp32.

[Note: payloads as two buffers]
A quantized payload is codes then fp32 block scales (runtime/quant.py). The eager runtime
moves it as one uint8 buffer; here the codes and the scales travel as two buffers of the
same algorithm — the same bytes in all, and no bitcast of a collective's output inside a
graph — encoded and decoded by opaque custom ops (runtime/quant_ops.py [Note: why
opaque]). The ledger counts the logical collective, whose bytes are the payload's. Functional collectives run on the group's own backend (gloo's
reduce-scatter included: the ledger counts logical bytes, not the backend's).
"""
from __future__ import annotations

from math import prod

import torch
import torch.distributed._functional_collectives as fc
import torch.fx.traceback as fx_traceback

from shardc.dsl.ir import Collectives, DType
from shardc.lowering import HO_PIECES, Row

from . import device, quant_ops
from .collectives import perm, pieces
from .dtypes import torch_dtype
from .mesh import ShardMesh


AS_TAG = "shardc_as"        # node.meta["custom"][AS_TAG]: the plan op a collective stands for


def _wait(t: torch.Tensor) -> torch.Tensor:
    return fc.wait_tensor(t)


class FunctionalComm:
    """Plan rows as functional collectives over a ShardMesh (see the module notes)."""

    def __init__(self, smesh: ShardMesh, algo: Collectives, rows=()):
        self.smesh, self.algo = smesh, algo
        self._native: dict[int, bool] = {}   # a group's reduce-scatter: its own op? (decided untraced)
        for row in rows:                     # every group made now, in the same order on every rank:
            key = smesh.digits(row.levels, row.order)    # a traced graph only looks them up
            for pg in (smesh.group(key, key), *(smesh.group((lvl,)) for lvl in key)):
                if pg is not None:
                    self._native[id(pg)] = device.native_reduce_scatter(pg, smesh.device_type)

    def _key(self, row: Row) -> tuple[tuple[str, ...], Collectives]:
        key = self.smesh.digits(row.levels, row.order)
        algo = self.algo
        if algo is Collectives.AUTO:
            algo = Collectives.HIERARCHICAL if len(key) >= 2 else Collectives.RING
        return key, (Collectives.RING if len(key) < 2 else algo)

    def _size(self, lvl: str) -> int:
        return self.smesh.mesh.size(lvl)

    # -- all_gather ----------------------------------------------------------------------
    def all_gather(self, row: Row | None, inp: torch.Tensor) -> torch.Tensor:
        """Every rank's `inp` (n/s, flat) concatenated by chunk index: the full n."""
        if row is None:
            return inp
        key, algo = self._key(row)
        if row.comm.quantized:                    # see [Note: payloads as two buffers]
            codes, scales = quant_ops.encode(inp, row.comm.bits)
            return self.all_gather_encoded(row, codes, scales, inp.numel(), row.comm.bits).to(inp.dtype)
        cdt = torch_dtype(row.comm)
        return self._gather(inp.to(cdt), key, algo).to(inp.dtype)

    def all_gather_encoded(self, row: Row | None, codes: torch.Tensor, scales: torch.Tensor, m: int,
                           bits: int) -> torch.Tensor:
        """The full n (float32) from every rank's encoded m-element chunk (codes, scales);
        row None: this rank's chunk is the whole, decoded."""
        if row is None:
            return quant_ops.decode(codes, scales, m, bits)
        key, algo = self._key(row)
        s = prod([self._size(n) for n in key])
        codes, scales = self._gather(codes, key, algo), self._gather(scales, key, algo)
        p, b = codes.numel() // s, scales.numel() // s
        return torch.cat([quant_ops.decode(codes[c * p:(c + 1) * p], scales[c * b:(c + 1) * b], m, bits)
                          for c in range(s)])

    def _gather(self, inp: torch.Tensor, key, algo) -> torch.Tensor:
        if algo is Collectives.RING:
            return _wait(fc.all_gather_single(inp, 0, self.smesh.group(key, key)))
        m = inp.numel()
        k = HO_PIECES if algo is Collectives.HO_RING else 1
        stages = self.smesh.mesh.ordered(key)
        names = tuple(reversed(stages))
        parts = []
        for lo, hi in pieces(m, k):
            buf = inp[lo:hi].contiguous()
            for lvl in stages:                              # outermost first
                buf = _wait(fc.all_gather_single(buf, 0, self.smesh.group((lvl,))))
            shaped = buf.view(*[self._size(n) for n in names], hi - lo)
            parts.append(shaped.permute(perm(names, key)))
        return torch.cat(parts, dim=-1).reshape(-1)

    # -- reduce_scatter -------------------------------------------------------------------
    def reduce_scatter(self, row: Row | None, inp: torch.Tensor) -> torch.Tensor:
        """This rank's chunk (by chunk index) of the sum of every rank's `inp` (n, flat)."""
        if row is None:
            return inp
        key, algo = self._key(row)
        s = prod([self._size(n) for n in key])
        if row.comm.quantized:
            return self._qgz(inp, key, row.comm, s)
        cdt = torch_dtype(row.comm)
        return self._scatter(inp.to(cdt), key, algo, s).to(inp.dtype)

    def _rs(self, inp: torch.Tensor, pg, s: int) -> torch.Tensor:
        """One reduce-scatter stage over `pg` (s ranks): the backend's own op, or on gloo
        all-to-all + sum (collectives.py [Note: reduce-scatter on gloo]), tagged so the
        record counts it as the reduce-scatter it is (graph_backend.py)."""
        if self._native[id(pg)]:
            return _wait(fc.reduce_scatter_single(inp, "sum", 0, pg))
        with fx_traceback.annotate({AS_TAG: "reduce_scatter"}):
            recv = _wait(fc.all_to_all_single(inp, None, None, pg))
        parts = recv.view(s, -1)
        return parts.float().sum(0).to(inp.dtype) if inp.dtype in (torch.float16, torch.bfloat16) else parts.sum(0)

    def _scatter(self, inp: torch.Tensor, key, algo, s: int) -> torch.Tensor:
        if algo is Collectives.RING:
            return self._rs(inp, self.smesh.group(key, key), s)
        m = inp.numel() // s
        names = tuple(reversed(self.smesh.mesh.ordered(key)))        # innermost first
        full = inp.view(*[self._size(n) for n in key], m).permute(perm(key, names))
        k = HO_PIECES if algo is Collectives.HO_RING else 1
        out = []
        for lo, hi in pieces(m, k):
            buf = full[..., lo:hi].contiguous().view(-1)
            for lvl in names:
                buf = self._rs(buf, self.smesh.group((lvl,)), self._size(lvl))
            out.append(buf)
        return torch.cat(out)

    def _qgz(self, inp: torch.Tensor, key, dtype: DType, s: int) -> torch.Tensor:
        m = inp.numel() // s
        parts = [quant_ops.encode(c, dtype.bits) for c in inp.view(s, m)]
        group = self.smesh.group(key, key)
        codes = _wait(fc.all_to_all_single(torch.cat([c for c, _ in parts]), None, None, group))
        scales = _wait(fc.all_to_all_single(torch.cat([sc for _, sc in parts]), None, None, group))
        p, b = codes.numel() // s, scales.numel() // s
        acc = sum([quant_ops.decode(codes[c * p:(c + 1) * p], scales[c * b:(c + 1) * b], m, dtype.bits)
                   for c in range(s)])
        return acc.to(inp.dtype)

    # -- all_reduce ------------------------------------------------------------------------
    def all_reduce(self, row: Row | None, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t` over the row's levels."""
        if row is None:
            return t
        key, algo = self._key(row)
        inner = prod([self._size(n) for n in key[1:]]) if len(key) > 1 else 1
        if algo is Collectives.RING or t.numel() < inner:
            return _wait(fc.all_reduce(t, "sum", self.smesh.group(key)))
        stages = self.smesh.mesh.ordered(key)
        outer, rest = stages[0], stages[1:]
        n = t.numel()
        flat = torch.cat([t.reshape(-1), t.new_zeros(-(-n // inner) * inner - n)])
        chunk = flat
        for lvl in reversed(rest):                                   # reduce-scatter, innermost first
            chunk = self._rs(chunk, self.smesh.group((lvl,)), self._size(lvl))
        chunk = _wait(fc.all_reduce(chunk, "sum", self.smesh.group((outer,))))
        for lvl in rest:                                             # all-gather, outermost first
            chunk = _wait(fc.all_gather_single(chunk, 0, self.smesh.group((lvl,))))
        return chunk[:n].view(t.shape)
