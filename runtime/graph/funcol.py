"""Functional collectives — stage: runtime (the whole-step compiled mode's collectives).

Input: a plan `Row` (`shardc.lowering`: levels, chunk digit order, wire dtype), a `ShardMesh`
(its groups) and the algorithm (`Collectives`), and the tensor a row moves.
Output: the result as a new tensor, computed with `torch.distributed._functional_collectives`
only, so dynamo traces it and Inductor compiles it inside the step's graphs (graph/step.py,
graph/boundary.py). The eager runtime's `eager/collectives.py` is the reference: every algorithm
here places chunks exactly as it does (its [Note: chunk placement]), so either runtime
loads the other's state.

[Note: the same algorithms, as graph ops]
An algorithm is its stages (shardc.algorithms [Note: an algorithm is its stages]): each
stage is one functional collective over the group positioned by its digits, with the same
local permutes before and after as the eager runtime's, and an algorithm with `pieces` > 1
(HO-Ring) runs each piece as its own chain of stages, so the graph holds the pieces'
stages side by side for Inductor to overlap. A reduce-scatter stage on a gloo group is an
`all_to_all_single` and a sum, as in the eager runtime (gloo's own reduce-scatter is an
all-reduce and a slice: 4/3 of a ring's bytes at 4 ranks); the choice is made per group
when the comm is built, not traced. int8/int4 all-gathers (qwZ) gather
the quantized payloads (runtime/transport/quant.py) with the row's algorithm and decode every chunk;
int8/int4 reduce-scatters (qgZ) are an `all_to_all_single` of the quantized chunks,
decoded and summed in fp32. The reduce-scatter's local halves (the gloo stage's sum, qgZ's
encode and decode-and-sum) are the eager runtime's own functions (runtime/transport/a2a.py [Note:
one reduce-scatter, two executors]).

[Note: payloads as two buffers]
A quantized payload is codes then fp32 block scales (runtime/transport/quant.py). The eager runtime
moves it as one uint8 buffer, and so does qgZ's all-to-all here (its payload rows are made
and read inside opaque ops); an all-gather's codes and scales travel as two buffers of the
same algorithm — the same bytes in all, and no bitcast of a collective's output inside a
graph — encoded and decoded by opaque custom ops (runtime/graph/quant_ops.py [Note: why
opaque]). The ledger counts the logical collective, whose bytes are the payload's. Functional collectives run on the group's own backend (gloo's
reduce-scatter included: the ledger counts logical bytes, not the backend's).
"""
from __future__ import annotations

from math import prod

import torch
import torch.distributed._functional_collectives as fc
import torch.fx.traceback as fx_traceback

import shardc.algorithms as algorithms
from shardc.algorithms.base import bounds, gather_perm, scatter_perm
from shardc.dsl.ir import Collectives, DType
from shardc.lowering import Row

from ..transport import a2a, device
from . import quant_ops
from ..dtypes import torch_dtype
from ..transport.mesh import ShardMesh


AS_TAG = "shardc_as"        # node.meta["custom"][AS_TAG]: the plan op a collective stands for


def _wait(t: torch.Tensor) -> torch.Tensor:
    return fc.wait_tensor(t)


class FunctionalComm:
    """Plan rows as functional collectives over a ShardMesh (see the module notes)."""

    def __init__(self, smesh: ShardMesh, algo: Collectives, rows=()):
        self.smesh, self.algo = smesh, str(algo)        # a plain str: traced code looks it up
        self._native: dict[int, bool] = {}   # a group's reduce-scatter: its own op? (decided untraced)
        for row in rows:                     # every group made now, in the same order on every rank:
            key, algo = self._key(row)       # a traced graph only looks them up
            plan = algo.reduce(key, smesh.mesh.ordered)
            stages = (key, *algo.gather(key, smesh.mesh.ordered), *algo.scatter(key, smesh.mesh.ordered),
                      *plan.scatter, plan.reduce, *plan.gather)
            for st in dict.fromkeys(stages):             # in order: groups are made collectively
                pg = smesh.group(st, st)
                if pg is not None:
                    self._native[id(pg)] = device.native_reduce_scatter(pg, smesh.device_type)

    def _key(self, row: Row):
        key = self.smesh.digits(row.levels, row.order)
        return key, algorithms.resolve(self.algo, key)

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
        stages = algo.gather(key, self.smesh.mesh.ordered)
        if stages == (key,) and algo.pieces == 1:
            return _wait(fc.all_gather_single(inp, 0, self.smesh.group(key, key)))
        m = inp.numel()
        names = [d for st in reversed(stages) for d in st]
        parts = []
        for lo, hi in bounds(m, algo.pieces):
            buf = inp[lo:hi].contiguous()
            for st in stages:
                buf = _wait(fc.all_gather_single(buf, 0, self.smesh.group(st, st)))
            shaped = buf.view(*[self._size(n) for n in names], hi - lo)
            parts.append(shaped.permute(gather_perm(stages, key)))
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
        all-to-all + sum (eager/collectives.py [Note: reduce-scatter on gloo]), tagged so the
        record counts it as the reduce-scatter it is (graph/backend.py)."""
        if self._native[id(pg)]:
            return _wait(fc.reduce_scatter_single(inp, "sum", 0, pg))
        with fx_traceback.annotate({AS_TAG: "reduce_scatter"}):
            recv = _wait(fc.all_to_all_single(inp, None, None, pg))
        return a2a.sum_rows(recv.view(s, -1))              # the eager runtime's sum (runtime/transport/a2a.py)

    def _scatter(self, inp: torch.Tensor, key, algo, s: int) -> torch.Tensor:
        stages = algo.scatter(key, self.smesh.mesh.ordered)
        if stages == (key,) and algo.pieces == 1:
            return self._rs(inp, self.smesh.group(key, key), s)
        m = inp.numel() // s
        full = inp.view(*[self._size(n) for n in key], m).permute(scatter_perm(stages, key))
        out = []
        for lo, hi in bounds(m, algo.pieces):
            buf = full[..., lo:hi].contiguous().view(-1)
            for st in stages:
                buf = self._rs(buf, self.smesh.group(st, st), prod([self._size(n) for n in st]))
            out.append(buf)
        return torch.cat(out)

    def _qgz(self, inp: torch.Tensor, key, dtype: DType, s: int) -> torch.Tensor:
        """qgZ as the eager runtime runs it (runtime/transport/a2a.py): the s chunks' payload rows, one
        all-to-all, their fp32 sum; the local halves as opaque ops (graph/quant_ops.py)."""
        send = quant_ops.qgz_send(inp, s, dtype.bits)
        recv = _wait(fc.all_to_all_single(send.view(-1), None, None, self.smesh.group(key, key)))
        return quant_ops.qgz_sum(recv.view(s, -1), inp.numel() // s, dtype.bits).to(inp.dtype)

    # -- all_reduce ------------------------------------------------------------------------
    def all_reduce(self, row: Row | None, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t` over the row's levels."""
        if row is None:
            return t
        key, algo = self._key(row)
        plan = algo.reduce(key, self.smesh.mesh.ordered)
        inner = prod([prod([self._size(n) for n in st]) for st in plan.scatter])
        if not plan.scatter or t.numel() < inner:
            return _wait(fc.all_reduce(t, "sum", self.smesh.group(key)))
        n = t.numel()
        view = torch.cat([t.reshape(-1), t.new_zeros(-(-n // inner) * inner - n)]).view(inner, -1)
        parts = []          # the algorithm's pieces: columns of the (inner, ·) view, as eagerly
        for lo, hi in bounds(view.shape[1], algo.pieces):
            chunk = view[:, lo:hi].contiguous().view(-1)
            for st in plan.scatter:                                  # reduce-scatter down
                chunk = self._rs(chunk, self.smesh.group(st, st), prod([self._size(x) for x in st]))
            chunk = _wait(fc.all_reduce(chunk, "sum", self.smesh.group(plan.reduce, plan.reduce)))
            for st in plan.gather:                                   # all-gather back up
                chunk = _wait(fc.all_gather_single(chunk, 0, self.smesh.group(st, st)))
            parts.append(chunk.view(inner, -1))
        return torch.cat(parts, dim=1).reshape(-1)[:n].view(t.shape)
