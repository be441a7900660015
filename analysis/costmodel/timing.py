"""Time model — seconds per collective and an estimated step time.

Input: ledger records (from `ledger.py`), a bandwidth model — `AlphaBeta` built from
`--intra/--inter` bandwidths and latencies (Lins §IV-A), or `Profile` (profile.py) read
from `shardc profile`'s JSON — and compute figures. Output: seconds per phase, a step-time
estimate, and `choose_collectives`, which resolves `collectives auto`.

[Note: alpha-beta per stage]
Seconds per collective come from `network.py` (see [Note: flat ring over several
levels] and [Note: staged algorithms] there): `AlphaBeta` gives the outermost level
`inter` links and every other level `intra` links (Lins §IV-A); `LevelLinks` one link
per level.

[Note: one in-node link]
`--intra` is the bandwidth per rank inside a node, and every level inside the outermost
one only names groups of the node's ranks: `gpu(2) > lane(4)` is how a strategy shards
over 4 of 8 GPUs (Lins eq. 3–6), and both levels' traffic goes through each GPU's one
in-node link. So `AlphaBeta` puts every inner level on the first inner level's link
([Note: shared links] in network.py): an 8-rank ring over `gpu(2) > lane(4)` runs at
`intra`, as over `gpu(8)`, not spread over two links at 4/3 of its speed (Lins §IV-A
likewise has one intra-node bandwidth). A measured `Profile` times each group as it
is, so sharing only says which collectives queue on one link in the step replay
(pipeline.py) and which stages of one composed from one-level entries run in turn; it
follows the same rule (`network.in_node_link`). Inner levels that are physically
separate links (Frontier's GPU and GCD links) are described with `--link`, one per level.

[Note: step time]
compute = FLOPs per micro-batch / achievable FLOP/s, the FLOPs counted on the captured
graph (attention and recomputation included, `flops.py`) or 6·Φ·tokens without one; the
achievable rate is `--tflops`, else a profile's measured rate ([Note: measured compute
rate] in shardc/cli/profile_compute.py), else `--flops`. Each collective's seconds split
into the part that occupies the cores (k, [Note: CPU share of a collective] in
profile.py; 0 without a CPU profile) and waiting for links (w = seconds − k). With
`prefetch` ≥ 1 the step costs every k, plus each micro-batch replayed on the plan's
schedule with the waits w (pipeline.py, [Note: pass pipeline]: compute and links in the
engine's order, so a link-bound pass shows the compute the links wait for and a
compute-bound one its first gathers and last reductions), the step's syncs on the links
of its last backward ([Note: sync overlap]), plus the update phase's waits, which hide
behind the next forward when the schedule defers them ([Note: deferred update
overlap]). With `prefetch 0` nothing overlaps: compute plus every collective's seconds.
The measured bandwidth model, `Profile`, and its notes live in profile.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Collectives, Mesh, Strategy

from shardc.analysis.costmodel.ledger import counted_rows
from shardc.lowering import PHASE_ORDER, Op, lower, placement_meshes, row_mesh
from shardc.analysis.costmodel.network import collective_seconds, in_node_link
import shardc.algorithms as algorithms
from shardc.analysis.costmodel.network import stage_sizes as _stage_sizes
from shardc.analysis.costmodel.pipeline import step, update_wait, waits_of
from shardc.analysis.costmodel.sizes import UnitSize, dense_flops


@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """α–β model: the outermost level's links run at `inter`; every other level's traffic
    goes through one in-node link at `intra` (bytes/s; [Note: one in-node link])."""
    intra: float = 100e9
    inter: float = 12.5e9
    intra_lat: float = 5e-6
    inter_lat: float = 20e-6

    def __str__(self) -> str:
        return (f"alpha-beta: intra {self.intra / 1e9:g} GB/s + {self.intra_lat * 1e6:g} us, "
                f"inter {self.inter / 1e9:g} GB/s + {self.inter_lat * 1e6:g} us per ring step")

    def link(self, mesh: Mesh, level: str) -> tuple[float, float]:
        """(latency, bytes/s) of `level`'s links: the outermost level is `inter`."""
        outer = level == mesh.names[0] and len(mesh.names) > 1
        return (self.inter_lat, self.inter) if outer else (self.intra_lat, self.intra)

    def key(self, mesh: Mesh, level: str) -> str:
        """The level whose links carry `level`'s traffic ([Note: one in-node link])."""
        return in_node_link(mesh, level)

    def seconds(self, op: Op, levels, nbytes: float, mesh: Mesh, algo: Collectives) -> float:
        return collective_seconds(op, levels, nbytes, mesh, algo, lambda l: self.link(mesh, l),
                                  lambda l: self.key(mesh, l))


@dataclass(frozen=True, slots=True)
class StepTime:
    compute: float
    comm: dict           # phase -> seconds of communication (not overlapped yet)
    total: float
    occupied: dict | None = None   # phase -> seconds of it that occupy the cores (CPU profile)

    @property
    def exposed(self) -> float:
        return self.total - self.compute


def phase_costs(rows, mesh: Mesh, bw, algo: Collectives, meshes=None) -> tuple[dict, dict]:
    """Per phase: (seconds, seconds that occupy the cores) of `counted_rows`; the second is 0
    unless `bw` is a profile with CPU seconds ([Note: CPU share of a collective]). A row is
    over its placement's mesh in `meshes` (`placement_meshes`; its levels' sizes are that mesh's)."""
    out, busy = {p: 0.0 for p in PHASE_ORDER}, {p: 0.0 for p in PHASE_ORDER}
    cost = getattr(bw, "cost", None)
    for r, n in rows:
        phase = r.phase.value
        on = row_mesh(r, mesh, meshes)
        t, k = cost(r.op, r.levels, r.bytes, on, algo, r.comm.value) if cost else \
            (bw.seconds(r.op, r.levels, r.bytes, on, algo), 0.0)
        out[phase] += n * t
        busy[phase] += n * k
    return out, busy


def step_time(strategy: Strategy, units: list[UnitSize], bw, *, micro_batches: int | None = None,
              tokens: int = 4096, flops: float = 150e12, algo: Collectives | None = None,
              mb_flops: float | None = None, passes=None, unit_flops=None) -> StepTime:
    """Estimated seconds of one optimizer step; see [Note: step time]. `mb_flops`: FLOPs
    one rank executes per micro-batch (from the graph, `flops.py`); default 6·Φ·tokens.
    `passes`: the plan passes the run uses (None: all of them); `unit_flops`: each unit's
    forward FLOPs (root first, from the graph), which place each unit's compute in the step."""
    m = strategy.accumulate if micro_batches is None else micro_batches
    algo = strategy.collectives if algo is None else algo
    if algo == Collectives.AUTO:
        algo = choose_collectives(strategy, units, bandwidth=bw, micro_batches=m)
    plan = lower(strategy.mesh, units, strategy.prefetch, passes)
    rows = counted_rows(plan, forwards=m, backwards=m)
    comm, k = phase_costs(rows, strategy.mesh, bw, algo, placement_meshes(strategy))
    c_mb = (dense_flops(units, tokens) if mb_flops is None else mb_flops) / flops
    if strategy.prefetch <= 0:
        total = m * c_mb + sum(comm.values())
    else:
        waits = waits_of(plan, strategy.mesh, bw, algo, phase_costs, placement_meshes(strategy))
        w_update, w_forward = comm["update"] - k["update"], (comm["forward"] - k["forward"]) / max(m, 1)
        total = (step(plan, waits, compute=c_mb, shares=_shares(units, unit_flops), micro_batches=m)
                 + k["forward"] + k["backward"] + k["sync"] + k["update"]
                 + update_wait(w_update, len(plan.schedule.update_deferred), c_mb / 3 - w_forward))
    return StepTime(compute=m * c_mb, comm=comm, total=total, occupied=k)


def _shares(units, unit_flops) -> list[float]:
    """Each unit's share of the model's compute: its traced forward FLOPs when given, else
    its trainable parameters (the 6·Φ·tokens rule)."""
    weights = list(unit_flops) if unit_flops is not None else [u.trainable for u in units]
    total = sum(weights)
    return [x / total if total else 1 / len(weights) for x in weights]


def _as_units(strategy: Strategy, unit_numels) -> list[UnitSize]:
    out = []
    for i, u in enumerate(unit_numels):
        if isinstance(u, UnitSize):
            out.append(u)
        elif isinstance(u, tuple):
            out.append(UnitSize(f"unit{i}", u[0], u[1], strategy.scopes, root=(i == 0)))
        else:
            out.append(UnitSize(f"unit{i}", int(u), 0, strategy.scopes, root=(i == 0)))
    return out


def choose_collectives(strategy: Strategy, unit_numels, *, bandwidth=None,
                       micro_batches: int | None = None) -> Collectives:
    """Resolve `collectives auto`: the algorithm with the least total communication time
    (the one place `auto` is chosen: shardc.algorithms [Note: what `auto` means]).

    `unit_numels`: per unit (root first) a `UnitSize`, a trainable element count, or a
    `(trainable, frozen)` pair (the last two use the strategy's scopes). An explicit
    choice in the strategy is returned unchanged; with no group spanning two or more
    levels every algorithm is the same ring and RING is returned.
    """
    if strategy.collectives != Collectives.AUTO:
        return strategy.collectives
    units = _as_units(strategy, unit_numels)
    m = strategy.accumulate if micro_batches is None else micro_batches
    rows = counted_rows(lower(strategy.mesh, units, strategy.prefetch), forwards=m, backwards=m)
    mesh = strategy.mesh
    if not any(len(_stage_sizes(mesh, r.levels)) > 1 for r, _ in rows):
        return Collectives.RING
    bw = bandwidth or AlphaBeta()
    best, best_t, missing = None, math.inf, None
    for algo in (Collectives(n) for n in algorithms.names()):      # registration order breaks ties
        try:
            t = sum(phase_costs(rows, mesh, bw, algo, placement_meshes(strategy))[0].values())
        except ShardcError as e:      # a profile without this algorithm: choose among the others
            missing = missing or e
            continue
        if t < best_t * (1 - 1e-9):
            best, best_t = algo, t
    if best is None:
        raise missing
    return best
