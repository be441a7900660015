"""Strategy -> JSON-ready dict — the view printed by `shardc check --json`.

Input: an `ir.Strategy`; output: plain dicts/lists/ints/strings (the `--json` form of docs/language.md):
`{"name", "mesh", "params", "grads", "optim", "accumulate", "prefetch", "collectives",
"buffers", "units", "bucket", "overrides", "experts", "warnings"}`, each scope with its levels
(mesh order) and shard factor; the experts' scopes' factors are over the experts' mesh
(`Strategy.expert_mesh`: the ranks ep leaves).
"""
from __future__ import annotations

from shardc.dsl.ir import GradsSpec, Mesh, OptimSpec, Override, ParamsSpec, Scopes, Strategy


def scopes_dict(scopes: Scopes, mesh: Mesh) -> dict:
    p, g, o = scopes.params, scopes.grads, scopes.optim
    secondary = None
    if p.secondary is not None:
        secondary = {"levels": list(p.secondary.levels), "factor": mesh.factor(p.secondary.levels),
                     "quant": p.secondary.quant.value if p.secondary.quant else None}
    return {
        "params": {"levels": list(p.levels), "factor": mesh.factor(p.levels), "secondary": secondary,
                   "comm": p.comm.value, "dtype": p.dtype.value},
        "grads": {"levels": list(g.levels), "factor": mesh.factor(g.levels),
                  "comm": g.comm.value, "dtype": g.dtype.value},
        "optim": {"levels": list(o.levels), "factor": mesh.factor(o.levels)}
                 | ({"by": o.granularity.value} if o.owned else {}),
    }


def strategy_dict(s: Strategy) -> dict:
    out = {"name": s.name, "mesh": [{"name": lv.name, "size": lv.size} for lv in s.mesh.levels]}
    out.update(scopes_dict(s.scopes, s.mesh))
    out.update({
        "accumulate": s.accumulate,
        "prefetch": s.prefetch,
        "collectives": s.collectives.value,
        "buffers": s.buffers.value,
        "units": {"kind": s.units.kind.value, "names": list(s.units.names)},
        "bucket": s.bucket,
        "overrides": [_override_dict(o, s.mesh) for o in s.overrides],
        "experts": _experts_dict(s),
        "warnings": list(s.warnings),
    })
    return out


def _override_dict(o: Override, mesh: Mesh) -> dict:
    """An override block: only the states it sets (the block is partial)."""
    full = scopes_dict(Scopes(o.params or ParamsSpec(), o.grads or GradsSpec(), o.optim or OptimSpec()), mesh)
    return dict(pattern=o.pattern, line=o.line, **{k: full[k] for k in o.sets()})


def _experts_dict(s: Strategy) -> dict | None:
    """The `experts` statement: its block's states as an override's (factors over the
    experts' mesh), null for a state the block does not set; null without the statement."""
    e = s.experts
    if e is None:
        return None
    full = scopes_dict(Scopes(e.params or ParamsSpec(), e.grads or GradsSpec(), e.optim or OptimSpec()),
                       s.expert_mesh)
    return {"pattern": e.pattern, "ep": e.ep, "level": e.level, "line": e.line,
            **{k: full[k] if getattr(e, k) is not None else None for k in ("params", "grads", "optim")}}
