"""Communication interface — stage: runtime (between the flat groups and the collectives).

Input: a plan `Row` (`shardc.lowering`: phase, op, levels, digit order, payload bytes, wire
dtype) and the tensors it moves, from a flat group (groups/flat_group.py) or the clip.
Output: a work handle whose `wait()` completes it; one logical `LedgerRecord` per recorded call.

`UnitCollectives` is the interface a flat group talks to (FSDP2's `_fsdp_api.py` is the
model): an explicit method per collective, each running one row. Two implement it:
`Comm` issues rows on the mesh's groups (runtime/transport/mesh.py, runtime/eager/collectives.py) and
records them in the ledger, so the ledger is recorded in one place; `GuardedComm`
(runtime/eager/faults.py) wraps another and names the unit in any failure.

[Note: no row, no collective]
The lowering owns which collectives exist: a collective over levels whose factor is 1 has
no row (lowering/rows.py). A caller passes the row it looked up; `None` means the plan has
none, and the data only moves locally (`collectives.local_copy`): nothing is issued or
recorded.
"""
from __future__ import annotations

import abc

import torch

from shardc.dsl.ir import Collectives, DType, Mesh
from shardc.lowering import Phase, Row

from . import collectives as C
from ..ledger import Ledger
from ..transport.mesh import ShardMesh


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


class UnitCollectives(abc.ABC):
    """What a flat group asks of the communication layer (see [Note: no row, no collective])."""

    @abc.abstractmethod
    def all_gather(self, row: Row | None, out: torch.Tensor, inp: torch.Tensor, *,
                   phase: Phase | None = None, record: bool = True):
        """out = every rank's `inp` concatenated by chunk index; `phase` overrides the row's
        in the ledger; `record=False` leaves the call out of it (checkpoint loads)."""

    @abc.abstractmethod
    def reduce_scatter(self, row: Row | None, out: torch.Tensor, inp: torch.Tensor, *, scratch=None):
        """out = this rank's chunk of the sum of every rank's `inp`."""

    @abc.abstractmethod
    def all_reduce(self, row: Row | None, t: torch.Tensor):
        """t = the sum of every rank's `t`, in place."""


class Comm(UnitCollectives):
    """Rows issued on a `ShardMesh`'s groups and recorded in a `Ledger`."""

    def __init__(self, mesh: Mesh, algo: Collectives, ledger: Ledger, shard_mesh: ShardMesh | None = None,
                 device_type: str = "cpu"):
        self.mesh = mesh
        self.algo = algo
        self.ledger = ledger
        self.smesh = shard_mesh if shard_mesh is not None else ShardMesh(mesh, device_type)

    @property
    def rank(self) -> int:
        return self.smesh.rank

    def _record(self, row: Row, phase: Phase | None = None) -> None:
        self.ledger.record_row(row, phase)

    def all_gather(self, row, out, inp, *, phase=None, record=True):
        if row is None:
            return C.local_copy(out, inp)
        if record:
            self._record(row, phase)
        return C.all_gather(out, inp, self.smesh, row.levels, row.order, algo=self.algo, comm=row.comm)

    def reduce_scatter(self, row, out, inp, *, scratch=None):
        if row is None:
            return C.local_copy(out, inp)
        self._record(row)
        return C.reduce_scatter(out, inp, self.smesh, row.levels, row.order, algo=self.algo,
                                comm=row.comm, scratch=scratch)

    def all_reduce(self, row, t):
        if row is None:
            return DoneWork()
        self._record(row)
        return C.all_reduce(t, self.smesh, row.levels, algo=self.algo)

    def gather(self, out: torch.Tensor, inp: torch.Tensor, levels, order) -> torch.Tensor:
        """A full buffer from this rank's chunk over `levels` outside any plan row (state
        dicts): unrecorded, waited, in `inp`'s dtype."""
        C.all_gather(out, inp, self.smesh, levels, order, algo=self.algo, comm=DType.FP32).wait()
        return out
