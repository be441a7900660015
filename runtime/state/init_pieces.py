"""The first rank's init sent as instructions — stage: runtime (state). On CPU, what
init_first.py's loop makes of each parameter reaches every rank as pieces of its chunks.

Input: the flat groups' storages, the data-parallel `ShardMesh` and group; on the first
rank, each parameter's final value or deferred op (`keep`) and each group's completion
(`finish`). Output: every rank's params shards written (draws drawn by the rank keeping
them, fills, values copied), each master following its shard, and the first rank's closing
box on every rank (`drain`). See init_first.py's [Note: each rank draws its part] and
draws.py's [Note: a lagging generator].
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from shardc.lowering import RankPlan

from .draws import Stream, segments, walk_to
from .draws import apply as apply_pieces
from .init import all_nan
from .untouched import Fill, Untouched

DRAWS = ("normal", "uniform")  # the pieces drawn by the rank keeping them (draws.py)


class Pieces:
    """On CPU: each rank's instructions for its chunks, sent in as few object scatters as
    the values held allow ([Note: each rank draws its part])."""

    def __init__(self, storages, smesh, group, device):
        self.storages, self.smesh, self.group, self.device = storages, smesh, group, device
        self.full: dict[int, torch.Tensor] = {}
        self.ops: dict[tuple[int, int], object] = {}    # (group, slot offset) -> Normal/Fill; None: values
        self.unset: set[str] = set()
        self.stream = Stream() if smesh.rank == 0 else None
        self.untouched = Untouched(stream=self.stream)
        self._chunks: dict[int, list] = {}
        self.outbox: list[list] = [[] for _ in range(smesh.mesh.world)]   # the first rank's unsent (group, piece)s
        self.positions: set = set()                # every draw's stream position sent (the first rank)
        self.draws: list = []                      # this rank's (group, draw piece)s, drawn in drain

    def chunks(self, k: int) -> list[tuple[int, int]]:
        """Every rank's params chunk of group k (start, length), by group rank."""
        if k not in self._chunks:
            st = self.storages[k]
            self._chunks[k] = [RankPlan(self.smesh.mesh, st.plan.scopes, r).chunk("params", st.n)
                               for r in range(self.smesh.mesh.world)]
        return self._chunks[k]

    def _parts(self, k: int, off: int, n: int):
        """(rank, at in its chunk, a, b): the elements [a, b) of a slot at `off` each rank keeps."""
        for r, (c, ln) in enumerate(self.chunks(k)):
            x, y = max(off, c), min(off + n, c + ln)
            if x < y:
                yield r, x - c, x - off, y - off

    def buffer(self, k: int) -> torch.Tensor:
        """Group k's buffer: `empty`, its pages touched only where ops run on parameters."""
        if k not in self.full:
            st = self.storages[k]
            self.full[k] = torch.empty(st.n, dtype=st.pdtype, device=self.device)
        return self.full[k]

    def keep(self, value: torch.Tensor, k: int, slot, name: str) -> None:
        """A parameter is final: its deferred op, or its values in the buffer."""
        dst = self.buffer(k)[slot.offset:slot.offset + slot.numel]
        op = None
        if value.data_ptr() != dst.data_ptr() or value.dtype != dst.dtype:
            self.untouched.forget(dst)
            dst.copy_(value.detach().reshape(-1))
        elif dst.is_floating_point() and self.untouched.pending(dst):
            self.untouched.forget(dst)
            op = Fill(float("nan"))           # no op touched it: NaN, unset
            self.unset.add(name)
        else:
            op = self.untouched.settle(dst)
        if op is None and dst.is_floating_point() and all_nan(dst):
            self.unset.add(name)
        self.ops[k, slot.offset] = op

    def finish(self, k: int, ok: bool) -> None:
        """Group k is final on the first rank: each rank's pieces of it queued; sent now when
        they hold values ("copy": at most one group's are held), else with the next send."""
        st = self.storages[k]
        buf = self.full.pop(k, None)
        values = False
        if ok:
            for s in st.layout.slots:
                op = self.ops.pop((k, s.offset), None)
                for r, at, a, b in self._parts(k, s.offset, s.numel):
                    if op is None:
                        values = True
                        self.outbox[r].append((k, ("copy", at, buf[s.offset + a:s.offset + b].clone())))
                    else:
                        self.outbox[r].append((k, op.piece(at, a, b)))
        if values:
            self._send(last=False)

    def receive(self, k: int) -> None:
        pass                               # the pieces come in the first rank's sends (drain)

    def _send(self, last: bool, closing=None) -> dict:
        """The queued pieces to every rank (one object scatter); the last send also carries the
        stream's runs, every rank's segment of positions to walk (draws.py's `segments`) and
        `closing()` (initialize_first's box: no broadcast of its own)."""
        world = self.smesh.mesh.world
        msgs = [{"pieces": self.outbox[r], "last": last} for r in range(world)]
        for r in range(world):
            self.positions.update(p[5] for _, p in self.outbox[r] if p[0] in DRAWS)
        if last:
            self.stream.catch_up_all()     # the first rank's generators where one process's are
            walks = segments(self.positions, self.stream.lengths, world)
            box = closing()
            for r in range(world):
                msgs[r].update(bases=self.stream.bases, walks=walks, closing=box)
        self.outbox = [[] for _ in range(world)]
        return self._receive(msgs)

    def _receive(self, msgs=None) -> dict:
        out = [None]
        if self.group is None:
            out = [msgs[0]]
        else:
            dist.scatter_object_list(out, msgs, group=self.group, group_src=0)
        for k, p in out[0]["pieces"]:
            if p[0] in DRAWS:
                self.draws.append((k, p))  # drawn once every position has its state (drain)
            else:
                apply_pieces([p], self.storages[k].shard)
        return out[0]

    def drain(self, closing) -> tuple:
        """Every send received; the draws' states found (each rank walks its segment, one
        all-gather of the states) and drawn; every group's master follows its shard. Returns
        the first rank's `closing()`."""
        me, world = self.smesh.rank, self.smesh.mesh.world
        if me == 0:
            msg = self._send(last=True, closing=closing)
        else:
            while not (msg := self._receive())["last"]:
                pass
        walks = msg["walks"]
        found = walk_to(walks[me], msg["bases"])
        size = max(len(w) for w in walks)
        if size:
            nbytes = msg["bases"][0].numel()
            mine = torch.zeros(size, nbytes, dtype=torch.uint8)
            for i, at in enumerate(walks[me]):
                mine[i] = found[at]
            every = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(every, mine, group=self.group)       # states are fixed-size: one collective
            # each its own storage (torch's set_rng_state reads a state from its storage's start),
            # kept for this rank's draws only, the gathered block freed before any draw
            need = {p[5] for _, p in self.draws}
            states = {at: every[r][i].clone() for r in range(world) for i, at in enumerate(walks[r]) if at in need}
            del every, mine, found
            for k, p in self.draws:
                apply_pieces([p[:5] + (states[p[5]],) + p[6:]], self.storages[k].shard)
        for st in self.storages:
            st.write_chunk(st.shard)       # the master follows the shard
        self.draws = []
        return msg["closing"]
