"""The first rank's init sent as instructions — stage: runtime (state). On CPU, what
init_first.py's loop makes of each parameter reaches every rank as pieces of its chunks.

Input: the flat groups' storages, the data-parallel `ShardMesh` and group; on the first
rank, each parameter made (`slot`: no byte until an op reads it), its final value or
deferred op (`keep`) and each group's completion (`finish`). Output: every rank's params shards written (draws drawn by the rank keeping
them, fills, values copied), each master following its shard, and the first rank's closing
box on every rank (`drain`). See init_first.py's [Note: each rank draws its part] and
draws.py's [Note: a lagging generator].
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from shardc.lowering import RankPlan

from .draws import Stream, segments, walk
from .draws import apply as apply_pieces
from .init import all_nan
from .untouched import Fill, Untouched, storage_key

DRAWS = ("normal", "uniform")  # the pieces drawn by the rank keeping them (draws.py)


def _same(value: torch.Tensor, made: torch.Tensor) -> bool:
    """`value` is still the tensor `slot` made (its storage, place, shape and dtype)."""
    return (storage_key(value) == storage_key(made) and value.dtype == made.dtype
            and value.storage_offset() == made.storage_offset() and value.shape == made.shape)


class Pieces:
    """On CPU: each rank's instructions for its chunks, sent in as few object scatters as
    the values held allow ([Note: each rank draws its part])."""

    def __init__(self, storages, smesh, group, device):
        self.storages, self.smesh, self.group, self.device = storages, smesh, group, device
        self.made: dict[tuple[int, int], torch.Tensor] = {}  # (group, slot offset) -> the parameter made
        self.values: dict[tuple[int, int], torch.Tensor] = {}  # (group, slot offset) -> final values, until sent
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

    def slot(self, k: int, s, shape) -> torch.Tensor:
        """The parameter at slot s of group k: a tensor of its own, with no byte until an op
        other than a deferred whole write touches it (untouched.py's [Note: storage at the
        first real op])."""
        t = self.untouched.lazy(shape, self.storages[k].pdtype, self.device)
        self.made[k, s.offset] = t
        return t

    def keep(self, value: torch.Tensor, k: int, slot, name: str) -> None:
        """A parameter is final: its deferred op, or its values (kept until its group is sent)."""
        made = self.made.pop((k, slot.offset))
        op = values = None
        if not _same(value, made):                # `fn` replaced it, or it is another dtype: its values, cast
            self.untouched.forget(made)
            values = value.detach().reshape(-1).to(made.dtype)
        elif made.is_floating_point() and self.untouched.pending(made):
            self.untouched.forget(made)
            op = Fill(float("nan"))           # no op touched it: NaN, unset
            self.unset.add(name)
        else:
            op = self.untouched.settle(made)
            values = made.detach().reshape(-1) if op is None else None
        if values is not None:
            if values.is_floating_point() and all_nan(values):
                self.unset.add(name)
            self.values[k, slot.offset] = values
        self.ops[k, slot.offset] = op

    def finish(self, k: int, ok: bool) -> None:
        """Group k is final on the first rank: each rank's pieces of it queued; sent now when
        they hold values ("copy": at most one group's are held), else with the next send."""
        st = self.storages[k]
        kept = {s.offset: self.values.pop((k, s.offset), None) for s in st.layout.slots}
        values = False
        if ok:
            for s in st.layout.slots:
                op = self.ops.pop((k, s.offset), None)
                for r, at, a, b in self._parts(k, s.offset, s.numel):
                    if op is None:
                        values = True
                        self.outbox[r].append((k, ("copy", at, kept[s.offset][a:b].clone())))
                    else:
                        self.outbox[r].append((k, op.piece(at, a, b)))
        del kept
        if values:
            self._send(last=False)

    def receive(self, k: int) -> None:
        pass                               # the pieces come in the first rank's sends (drain)

    def _send(self, last: bool) -> dict:
        """The queued pieces to every rank (one object scatter), `last` marking the last send."""
        world = self.smesh.mesh.world
        msgs = [{"pieces": self.outbox[r], "last": last} for r in range(world)]
        for r in range(world):
            self.positions.update(p[5] for _, p in self.outbox[r] if p[0] in DRAWS)
        self.outbox = [[] for _ in range(world)]
        return self._receive(msgs)

    def _common(self, closing) -> dict:
        """What every rank takes from the first after the last send: the stream's runs, every
        rank's segment of positions to walk (draws.py's `segments`) and `closing()`
        (initialize_first's box). One broadcast: an object scatter pickles a copy per rank."""
        box = [None]
        if self.smesh.rank == 0:
            self.stream.catch_up_all()     # the first rank's generators where one process's are
            walks = segments(self.positions, self.stream.lengths, self.smesh.mesh.world)
            box = [{"bases": self.stream.bases, "walks": walks, "closing": closing()}]
        dist.broadcast_object_list(box, group=self.group, group_src=0)
        return box[0]

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
        """Every send received; the draws' states found (each rank walks its segment, the
        states gathered a round at a time) and drawn; every group's master follows its shard. Returns
        the first rank's `closing()`."""
        if self.smesh.rank == 0:
            self._send(last=True)
        else:
            while not self._receive()["last"]:
                pass
        msg = self._common(closing)
        self._draw(msg["walks"], msg["bases"])
        for st in self.storages:
            st.write_chunk(st.shard)       # the master follows the shard
        self.draws = []
        return msg["closing"]

    def _draw(self, walks: list, bases: list) -> None:
        """This rank's draws, each from the state at its position: in rounds, each rank walking
        to the next position of its segment and one all-gather giving every rank that state of
        every rank; the draws starting at those positions drawn at once, and the states
        dropped ([Note: states a round at a time]).

        [Note: states a round at a time]
        A state is 5,056 bytes (torch's CPU generator) and a rank draws from one per draw of
        every parameter it keeps part of: gathered at once (one all-gather of every walked
        state) a rank held all of them, its walk's and the world's, beside its shards at
        start-up's peak: +1.3-2.0 MB on each rank of the 836M Llama at 8 ranks, tracked above
        FSDP2's. The rounds hold the walk's current state, one send and one receive buffer for
        all of them (a fresh pair each round could meet the last round's still held by gloo:
        4 gloo ranks measured world states more on some runs), a draw's copy of its state and
        the generator state `apply` saves: world + 4 states, 61 KB at 8 ranks. Rounds: the
        longest segment's positions (the draws per rank, about one per parameter drawn)."""
        me, world = self.smesh.rank, self.smesh.mesh.world
        size = max(len(w) for w in walks)
        if not size:
            return
        todo: dict[tuple, list] = {}
        for k, p in self.draws:
            todo.setdefault(p[5], []).append((k, p))
        states = walk(walks[me], bases)
        n = bases[0].numel()
        mine, every = torch.zeros_like(bases[0]), bases[0].new_empty(world * n)   # one pair for every round
        for i in range(size):
            if i < len(walks[me]):
                mine.copy_(next(states))
            dist.all_gather_single(every, mine, group=self.group)   # fixed-size states: one collective
            for r in range(world):
                for k, p in todo.pop(walks[r][i], ()) if i < len(walks[r]) else ():
                    state = every[r * n:(r + 1) * n].clone()   # its own storage: torch's set_rng_state reads from its start
                    apply_pieces([p[:5] + (state,) + p[6:]], self.storages[k].shard)
                    del state
        del mine, every
        assert not todo, f"draws at positions no rank walked: {sorted(todo)[:3]}"     # segments cover every position
