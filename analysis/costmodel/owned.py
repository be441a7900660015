"""Tensor-owned optimizer states in the cost model — stage: analysis (explain).

Input: a Strategy with an `optim ... by tensor` scope (dsl/ir.py [Note: tensor-owned
scopes]), the model (its parameters' shapes; a meta model will do) and the plan.
Output: `Owned`: the owners (`OwnedPlan`, lowering/owned.py: the one assignment, the
runtime's too), the ledger with the owners' two all-to-alls added (once per step), the
optimizer-state bytes of every rank (they differ: each rank holds the whole states of the
matrices it owns), and the lines `shardc explain` prints about them (`owners_doc`: the
same owners as `explain --json`'s "owners", read from the plan the Explained carries).

[Note: optim bytes under tensor ownership]
Rank r holds, per trainable flat group, its optim chunk (N / s_OS elements of the fp32
master where the params dtype is not fp32, as for any layout) and the element-wise
optimizer's state of that chunk's non-owned elements (K_flat each; the padding rides on
the group's last parameter, so it counts only when that parameter is not owned), plus the
whole-tensor optimizer's state of the matrices it owns (K_owned per element of each) and
the element-wise optimizer's state of the other tensors it owns (K_flat per element:
lowering/owned.py [Note: the element-wise remainder is owned too]).
`memory_report()` measures exactly these tensors.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from shardc.dsl.ir import Strategy
from shardc.lowering import Lowering, Over, RankPlan, ledger_key, merged, placement_meshes
from shardc.lowering.layout import mixed_index
from shardc.lowering.owned import OwnedPlan, ns_flops, owned_plan

__all__ = ["Owned", "owned_of", "with_owned_rows", "optim_bytes_per_rank", "owners_lines", "explain_owned",
           "NS_STEPS", "ns_step_flops", "owner_flops", "owners_doc"]

NS_STEPS = 5                      # torch.optim.Muon's default ns_steps


@dataclass(frozen=True, slots=True)
class Owned:
    plan: OwnedPlan
    units: tuple                      # the UnitSpecs (overrides applied), root first
    shapes: dict                      # canonical FQN -> shape
    trainable: dict                   # canonical FQN -> bool


def owned_of(strategy: Strategy, model) -> Owned | None:
    """The owners of `model`'s matrices under `strategy` (None: no scope is by tensor)."""
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.units import find_units
    units = tuple(find_units(model, resolve_bucket(model, strategy)))
    if not any(u.scopes.optim.owned for u in units):
        return None
    named = dict(model.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in named.items()}
    trainable = {n: p.requires_grad for n, p in named.items()}
    return Owned(owned_plan(strategy.mesh, units, shapes, trainable), units, shapes, trainable)


def with_owned_rows(records, owned: Owned) -> list:
    """The ledger `records` (one step's) with the owners' rows, once each."""
    counts: Counter = Counter()
    for r in records:
        counts[(r.phase, r.op, tuple(r.levels), r.bytes, r.over)] += r.count
    for row in owned.plan.rows:
        counts[ledger_key(row)] += 1
    return merged(counts)


def ns_step_flops(shape, steps: int = NS_STEPS) -> int:
    """FLOPs of torch.optim.Muon's Newton–Schulz on an m×n matrix: `steps` iterations of
    lowering/owned.py's `ns_flops` (the count the owners are balanced by)."""
    return steps * ns_flops(shape)


def owner_flops(owned: Owned) -> list[tuple[int, ...]]:
    """Per owner group: each owner's Newton–Schulz FLOPs per step."""
    out = []
    for g in owned.plan.groups:
        if not g.matrices:                       # the element-wise remainder: no Newton–Schulz
            continue
        load = [0] * g.ranks
        for t in g.tensors:
            load[t.owner] += ns_step_flops(t.shape)
        out.append(tuple(load))
    return out


def optim_bytes_per_rank(strategy: Strategy, lowering: Lowering, owned: Owned, *, k_flat: int,
                         k_owned: int) -> list[int]:
    """Optimizer-state bytes of every rank ([Note: optim bytes under tensor ownership])."""
    mesh = strategy.mesh
    names = owned.plan.owner_of()
    out = []
    for rank in range(mesh.world):
        total = 0
        for spec, up in zip(owned.units, lowering.units):
            for g in up.groups:
                if g.placement.over != Over.DENSE:
                    continue
                total += g.master_bytes
                if not g.trainable:
                    continue
                start, length = RankPlan(mesh, up.scopes, rank).chunk("optim", g.n)
                slots = [n for n in spec.params if owned.trainable[n]]
                offset, flat = 0, 0
                for k, n in enumerate(slots):
                    numel = _numel(owned.shapes[n])
                    lo, hi = max(start, offset), min(start + length, offset + numel)
                    if k == len(slots) - 1:                  # the padding rides on the last piece
                        lo, hi = max(start, offset), start + length
                    if n not in names:
                        flat += max(0, hi - lo)
                    offset += numel
                total += k_flat * flat
        for g in owned.plan.groups:
            pos = mixed_index(mesh, rank, g.order)
            total += (k_owned if g.matrices else k_flat) * g.owned_elems(pos)
        out.append(total)
    return out


def owners_lines(owned: Owned) -> list[str]:
    """What explain prints: per owner group, each owner's tensors and what they are balanced
    by (the matrices' Newton–Schulz FLOPs, the remainder's elements)."""
    lines = []
    for g in owned.plan.groups:
        load = g.load()
        mean = sum(load) / len(load)
        what, by = (("matrices", "balanced by Newton–Schulz FLOPs per iteration") if g.matrices else
                    ("other tensors, element-wise", "balanced by elements"))
        lines.append(f"tensor owners over {', '.join(g.levels) or 'one rank'} ({len(g.tensors)} {what}, "
                     f"{g.ranks} owners; {by}, most-loaded owner "
                     f"{100 * g.imbalance():+.1f} % of the mean):")
        for pos in range(g.ranks):
            mats = [t.name for t in g.tensors if t.owner == pos]
            share = f"{100 * (load[pos] / mean - 1):+.1f} %" if mean else "—"
            shown = ", ".join(mats[:3]) + (f" and {len(mats) - 3} more" if len(mats) > 3 else "")
            cost = f", cost {load[pos]:.3g}" if g.matrices else ""
            lines.append(f"  owner {pos}: {len(mats)} {'matrices' if g.matrices else 'tensors'}, "
                         f"{g.owned_elems(pos)} elements{cost} ({share}): {shown or 'none'}")
    return lines


def owners_doc(plan: OwnedPlan) -> list[dict]:
    """`explain --json`'s "owners": per owner group (`kind` "matrices" or "elementwise"),
    the owner of each tensor and each owner's load (Newton–Schulz FLOPs per iteration of the
    matrices; elements of the remainder, whose `flops` are 0), its share of the group's and
    its distance from the mean."""
    out = []
    for g in plan.groups:
        load = g.load()
        total = sum(load)
        mean = total / len(load)
        out.append({
            "levels": list(g.levels), "owners": g.ranks, "imbalance": g.imbalance(),
            "kind": "matrices" if g.matrices else "elementwise",
            "tensors": [{"name": t.name, "shape": list(t.shape), "owner": t.owner, "flops": t.flops}
                        for t in g.tensors],
            "per_owner": [{"owner": pos, "matrices": sum(1 for t in g.tensors if t.owner == pos),
                           "elements": g.owned_elems(pos), "flops": load[pos] if g.matrices else 0,
                           "share": load[pos] / total if total else 0.0,
                           "vs_mean": load[pos] / mean - 1.0 if mean else 0.0} for pos in range(g.ranks)],
        })
    return out


def explain_owned(e, model, *, k_flat: int, k_owned: int, flops: float | None = None, bandwidth=None):
    """`e` (an `Explained`) with the owners' rows in its ledger and link bytes, the
    most-loaded rank's optimizer states in its memory and, at `flops` FLOP/s, the most-loaded
    owner's Newton–Schulz time in its step time (after the sync, not overlapped), with the
    owners' two all-to-alls on `bandwidth` (exposed: they bracket the optimizer step), and the
    lines explain prints about the owners; `(e, [])` when no scope is by tensor."""
    import dataclasses

    from shardc.analysis.costmodel.links import inter_intra, link_bytes
    s = e.strategy
    owned = owned_of(s, model)
    if owned is None:
        return e, []
    records = tuple(with_owned_rows(e.ledger, owned))
    links = link_bytes(records, s.mesh, e.algo, placement_meshes(s))
    inter, intra = inter_intra(links, s.mesh)
    per_rank = optim_bytes_per_rank(s, e.plan, owned, k_flat=k_flat, k_owned=k_owned)
    memory = dict(e.memory)
    memory["optim"] = max(per_rank)
    memory["total"] = sum(memory[k] for k in ("params", "params_secondary", "grads", "optim"))
    lines = owners_lines(owned) + [
        f"optimizer states per rank (element-wise K={k_flat} on chunks and owned non-matrices, whole-tensor "
        f"K={k_owned} on owned matrices): " + ", ".join(f"rank {r} {b:,}" for r, b in enumerate(per_rank[:8]))
        + (f" ... ({len(per_rank)} ranks; memory shows the largest)" if len(per_rank) > 8 else
           " (memory shows the largest)")]
    time, rates = e.time, e.rates
    if flops and time is not None:
        loads = owner_flops(owned)
        worst = sum(max(l) for l in loads) / flops
        mean = sum(sum(l) / len(l) for l in loads) / flops
        every = sum(sum(l) for l in loads) / flops
        lines.append(f"optimizer step (Muon's Newton–Schulz, {NS_STEPS} iterations) at {flops:.3g} FLOP/s: "
                     f"most-loaded owner {worst * 1e3:.3g} ms, mean {mean * 1e3:.3g} ms "
                     f"(every matrix on every rank: {every * 1e3:.3g} ms); added to the step time")
        time = dataclasses.replace(time, compute=time.compute + worst, total=time.total + worst)
    if bandwidth is not None and time is not None:
        from shardc.analysis.costmodel.timing import phase_costs
        cost, _ = phase_costs([(r, 1) for r in owned.plan.rows], s.mesh, bandwidth, e.algo, placement_meshes(s))
        comm = {k: v + cost.get(k, 0.0) for k, v in time.comm.items()}
        time = dataclasses.replace(time, comm=comm, total=time.total + sum(cost.values()))
    if time is not e.time:
        if rates:
            rates = {k: (v * e.time.total / time.total if k in ("tokens_per_s", "mfu") else v)
                     for k, v in rates.items()}
    plan = dataclasses.replace(e.plan, owned=owned.plan) if e.plan is not None else None
    return dataclasses.replace(e, ledger=records, links=links, inter=inter, intra=intra, memory=memory,
                               time=time, rates=rates, plan=plan), lines


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
