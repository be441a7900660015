"""Communication adapter — stage: runtime.

Input: collective requests from flat groups (levels, digit order, comm dtype, the
ledger bytes computed by the caller from the internals.md table).
Output: async work handles; one logical `LedgerRecord` per call.

Groups come from `ShardMesh` (runtime/mesh.py) and the collectives from
runtime/collectives.py. Every call goes through here so the ledger is recorded in one
place, with the same phase/op/levels rules everywhere.
"""
from __future__ import annotations

import torch

from shardc.dsl.ir import Collectives, DType, Mesh

from .ledger import Ledger


class DoneWork:
    """Already-complete work (nothing to communicate)."""

    def wait(self) -> bool:
        return True


class ThenWork:
    """Work followed by a local step (e.g. dequantize) once it completes."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self) -> bool:
        self.work.wait()
        if self.then is not None:
            self.then()
            self.then = None
        return True


class Comm:
    def __init__(self, mesh: Mesh, algo: Collectives, ledger: Ledger, shard_mesh=None,
                 device_type: str = "cpu"):
        from . import collectives as C
        from .mesh import ShardMesh
        self.mesh = mesh
        self.algo = algo
        self.ledger = ledger
        self.C = C
        self.smesh = shard_mesh if shard_mesh is not None else ShardMesh(mesh, device_type)

    @property
    def rank(self) -> int:
        return self.smesh.rank

    def _levels(self, levels) -> tuple[str, ...]:
        return self.mesh.ordered(levels)

    def all_gather(self, phase: str, out: torch.Tensor, inp: torch.Tensor, levels, order,
                   nbytes: int, comm: DType = DType.FP32):
        levels = self._levels(levels)
        if not levels or self.mesh.factor(levels) == 1:
            out.copy_(inp.reshape(out.shape)) if out.data_ptr() != inp.data_ptr() else None
            return DoneWork()
        self.ledger.record(phase, "all_gather", levels, nbytes)
        return self.C.all_gather(out, inp, self.smesh, levels, tuple(order), algo=self.algo,
                                 comm=comm)

    def reduce_scatter(self, phase: str, out: torch.Tensor, inp: torch.Tensor, levels, order,
                       nbytes: int, comm: DType = DType.FP32, scratch=None):
        levels = self._levels(levels)
        if not levels or self.mesh.factor(levels) == 1:
            out.copy_(inp)
            return DoneWork()
        op = "all_to_all" if comm.quantized else "reduce_scatter"
        self.ledger.record(phase, op, levels, nbytes)
        return self.C.reduce_scatter(out, inp, self.smesh, levels, tuple(order),
                                     algo=self.algo, comm=comm, scratch=scratch)

    def all_reduce(self, phase: str, t: torch.Tensor, levels, nbytes: int):
        levels = self._levels(levels)
        if not levels or self.mesh.factor(levels) == 1:
            return DoneWork()
        self.ledger.record(phase, "all_reduce", levels, nbytes)
        return self.C.all_reduce(t, self.smesh, levels, algo=self.algo)
