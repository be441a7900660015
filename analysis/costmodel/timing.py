"""Time model — seconds per collective and an estimated step time.

Input: ledger records (from `ledger.py`), a bandwidth model — `AlphaBeta` built from
`--intra/--inter` bandwidths and latencies (Lins §IV-A), or `Profile` read from
`shardc profile`'s JSON — and compute figures. Output: seconds per phase, a step-time
estimate, and `choose_collectives`, which resolves `collectives auto`.

[Note: alpha-beta per stage]
Seconds per collective come from `network.py` (see [Note: flat ring over several
levels] and [Note: staged algorithms] there): `AlphaBeta` gives the outermost level
`inter` links and every other level `intra` links (Lins §IV-A); `LevelLinks` one link
per level.

[Note: step time]
compute = FLOPs per micro-batch / achievable FLOP/s, the FLOPs counted on the captured
graph (attention and recomputation included, `flops.py`) or 6·Φ·tokens without one. Forward/backward collectives overlap the
compute when `prefetch` ≥ 1, so each micro-batch costs max(compute, its comm); the sync
phase hides behind whatever of the last backward (2/3 of a micro-batch's compute) its
own backward collectives leave free; the update phase is exposed. With `prefetch 0`
nothing overlaps.
"""
from __future__ import annotations

import json
import math
import re
from bisect import bisect_left
from dataclasses import dataclass
from math import prod

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import Collectives, Mesh, Strategy

from shardc.analysis.costmodel.ledger import predict_ledger
from shardc.lowering import PHASE_ORDER
from shardc.analysis.costmodel.network import collective_seconds
from shardc.analysis.costmodel.network import combine as _combine, stage_sizes as _stage_sizes
from shardc.analysis.costmodel.sizes import UnitSize, dense_flops

@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """α–β model: the outermost level's links run at `inter`, all others at `intra` (bytes/s)."""
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

    def seconds(self, op: str, levels, nbytes: float, mesh: Mesh, algo: Collectives) -> float:
        return collective_seconds(op, levels, nbytes, mesh, algo, lambda l: self.link(mesh, l))


@dataclass(frozen=True, slots=True)
class Profile:
    """Measured bandwidths: `{(op, levels, algo): ((bytes, seconds), ...)}` sorted by bytes."""
    entries: dict

    def __str__(self) -> str:
        return f"bandwidth profile ({len(self.entries)} measured groups)"

    @classmethod
    def load(cls, path: str) -> "Profile":
        try:
            with open(path) as f:
                data = json.load(f)
            raw = data["entries"]
            table: dict = {}
            for e in raw:
                key = (e["op"], tuple(e["levels"]), e.get("algo", "ring"))
                table.setdefault(key, []).append((float(e["bytes"]), float(e["seconds"])))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ShardcError(f"cannot read bandwidth profile {path}: {e}") from None
        return cls({k: tuple(sorted(v)) for k, v in table.items()})

    def _lookup(self, op: str, levels: tuple[str, ...], algo: str, nbytes: float) -> float | None:
        pts = self.entries.get((op, levels, algo))
        if pts is None and len(levels) == 1:   # one level: every algorithm is the same ring
            pts = next((v for (o, l, _), v in self.entries.items() if o == op and l == levels), None)
        if pts is None:
            return None
        if nbytes <= 0:
            return 0.0
        return nbytes / _interp_bw(pts, nbytes)

    def seconds(self, op: str, levels, nbytes: float, mesh: Mesh, algo: Collectives) -> float:
        sizes = _stage_sizes(mesh, levels)
        if not sizes:
            return 0.0
        names = tuple(l for l, _ in sizes)
        if op == "all_to_all":   # qgZ: one flat all-to-all; `shardc profile` does not time it, and a
            algo = Collectives.RING          # ring reduce-scatter sends the same (p−1)/p·V per rank
            t = self._lookup(op, names, "ring", nbytes)
            op = "reduce_scatter" if t is None else op
        t = self._lookup(op, names, algo.value, nbytes)
        if t is not None:
            return t
        if len(sizes) > 1 and algo != Collectives.RING:   # compose the stages from one-level entries
            stages = []
            for i, (l, _) in enumerate(sizes):
                inner = prod(x for _, x in sizes[i + 1:])
                st = self._lookup(op, (l,), "ring", nbytes / inner)
                if st is None:
                    break
                stages.append(st)
            else:
                return _combine(stages, algo)
        raise ShardcError(f"the bandwidth profile has no {op} entry over {', '.join(names)} "
                          f"({algo.value}); profile that group or pass --intra/--inter")


def _interp_bw(pts, nbytes: float) -> float:
    """Bandwidth (bytes/s) at `nbytes`, linear in log(bytes) between measured sizes, clamped."""
    sizes = [b for b, _ in pts]
    bws = [b / s for b, s in pts]
    i = bisect_left(sizes, nbytes)
    if i == 0:
        return bws[0]
    if i == len(sizes):
        return bws[-1]
    x0, x1 = math.log(sizes[i - 1]), math.log(sizes[i])
    t = (math.log(nbytes) - x0) / (x1 - x0) if x1 > x0 else 0.0
    return bws[i - 1] + t * (bws[i] - bws[i - 1])


@dataclass(frozen=True, slots=True)
class StepTime:
    compute: float
    comm: dict           # phase -> seconds of communication (not overlapped yet)
    total: float

    @property
    def exposed(self) -> float:
        return self.total - self.compute


def phase_seconds(records, mesh: Mesh, bw, algo: Collectives) -> dict[str, float]:
    out = {p: 0.0 for p in PHASE_ORDER}
    for r in records:
        out[r.phase] += r.count * bw.seconds(r.op, r.levels, r.bytes, mesh, algo)
    return out


def step_time(strategy: Strategy, units: list[UnitSize], bw, *, micro_batches: int | None = None,
              tokens: int = 4096, flops: float = 150e12, algo: Collectives | None = None,
              mb_flops: float | None = None) -> StepTime:
    """Estimated seconds of one optimizer step; see [Note: step time]. `mb_flops`: FLOPs
    one rank executes per micro-batch (from the graph, `flops.py`); default 6·Φ·tokens."""
    m = strategy.accumulate if micro_batches is None else micro_batches
    algo = strategy.collectives if algo is None else algo
    if algo == Collectives.AUTO:
        algo = choose_collectives(strategy, units, bandwidth=bw, micro_batches=m)
    records = predict_ledger(strategy, units, micro_batches=m)
    comm = phase_seconds(records, strategy.mesh, bw, algo)
    c_mb = (dense_flops(units, tokens) if mb_flops is None else mb_flops) / flops
    if strategy.prefetch <= 0:
        total = m * c_mb + sum(comm.values())
    else:
        f_mb = (comm["forward"] + comm["backward"]) / max(m, 1)
        slack = max(0.0, 2 / 3 * c_mb - comm["backward"] / max(m, 1))
        total = m * max(c_mb, f_mb) + max(0.0, comm["sync"] - slack) + comm["update"]
    return StepTime(compute=m * c_mb, comm=comm, total=total)


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
    """Resolve `collectives auto`: the algorithm with the least total communication time.

    `unit_numels`: per unit (root first) a `UnitSize`, a trainable element count, or a
    `(trainable, frozen)` pair (the last two use the strategy's scopes). An explicit
    choice in the strategy is returned unchanged; with no group spanning two or more
    levels every algorithm is the same ring and RING is returned.
    """
    if strategy.collectives != Collectives.AUTO:
        return strategy.collectives
    units = _as_units(strategy, unit_numels)
    records = predict_ledger(strategy, units, micro_batches=micro_batches)
    mesh = strategy.mesh
    if not any(len(_stage_sizes(mesh, r.levels)) > 1 for r in records):
        return Collectives.RING
    bw = bandwidth or AlphaBeta()
    best, best_t, missing = None, math.inf, None
    for algo in (Collectives.HIERARCHICAL, Collectives.RING, Collectives.HO_RING):
        try:
            t = sum(phase_seconds(records, mesh, bw, algo).values())
        except ShardcError as e:      # a profile without this algorithm: choose among the others
            missing = missing or e
            continue
        if t < best_t * (1 - 1e-9):
            best, best_t = algo, t
    if best is None:
        raise missing
    return best


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def _number(m) -> float:
    """The number a `parse_*` regex matched first, or -1 when there is none."""
    try:
        return float(m.group(1)) if m else -1.0
    except ValueError:
        return -1.0


def parse_rate(text: str) -> float:
    """'100GB/s', '25Gbit/s', '12.5e9' -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgGtT]i?)?(B|bit|b)?(/s)?\s*", str(text))
    value = _number(m)
    if value <= 0:
        raise ShardcError(f"cannot read bandwidth {text!r}; write e.g. 100GB/s or 25Gbit/s")
    scale = _UNITS[(m.group(2) or "").lower()]
    bits = m.group(3) in ("bit", "b")
    return value * scale / (8 if bits else 1)


def parse_seconds(text: str) -> float:
    """'5us', '0.1ms', '2e-5' -> seconds."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us|ns)?\s*", str(text))
    value = _number(m)
    if value < 0:
        raise ShardcError(f"cannot read latency {text!r}; write e.g. 5us or 0.1ms")
    return value * {"s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9, None: 1}[m.group(2)]
