"""Cross-statement checks — part of stage 2 (AST -> **Strategy**).

Input: the resolved scopes of the strategy, of each override and of the `experts` block,
each bound to the statement that set it (`bound`: state -> (spec, Statement | None); a
block's also carries `_label`, the states it sets `_own`, and for the experts `_drop`, the
level ep takes whole); output: diagnostics.

Error: the dependency rule levels(params) ⊆ levels(grads) ⊆ levels(optim)
(Lins §IV-B, ZeRO-topo §V). Warnings: a scope holding an outer level without every
level inside it (Lins eq. 7), `collectives ho-ring` with no multi-level scope, and
`accumulate 1` where partial gradient synchronisation needs accumulation
(grads sharded over a strict subset of optim's levels: PaRO-IIG/NIG).
"""
from __future__ import annotations

from shardc.dsl import ast
from shardc.dsl.diagnostics import Diagnostic, Note, error, warning
import shardc.algorithms as algorithms
from shardc.dsl.ir import DEPENDENCY, STATES, Collectives, Mesh, Scopes

RULE_HINT = ("a rank must hold the gradients and optimizer states of every parameter chunk it owns: "
             "levels(params) ⊆ levels(grads) ⊆ levels(optim)")


def _desc(levels) -> str:
    return ", ".join(levels) if levels else "nothing (replicate)"


def _where(stmt: ast.Statement | None, key: str) -> str:
    return f"`{key}` (line {stmt.span.line})" if stmt else f"`{key}` (not given: replicate)"


def dependency(bound: dict, diags: list[Diagnostic]) -> None:
    """Check params ⊆ grads ⊆ optim; for an override, only pairs it touches."""
    label = bound.get("_label")
    own = bound.get("_own")
    scopes = Scopes(*(bound[k][0] for k in STATES))
    for inner, outer in DEPENDENCY:
        (ispec, istmt), (ospec, ostmt) = bound[inner], bound[outer]
        if own is not None and inner not in own and outer not in own:
            continue
        missing = scopes.missing(inner, outer)
        if not missing:
            continue
        prefix = f"in {label}: " if label else ""
        message = (f"{prefix}dependency rule: {_where(ostmt, outer)} does not shard over "
                   f"{', '.join(f'`{m}`' for m in missing)}, which {_where(istmt, inner)} shards over")
        main, other = (ostmt, istmt) if ostmt is not None else (istmt, None)
        notes = [Note(other.scope.span, f"`{inner}` shards over {_desc(ispec.levels)} here")] if other else []
        hint = f"{RULE_HINT}; add {', '.join(missing)} to `{outer}` or remove it from `{inner}`"
        drop = bound.get("_drop")
        if drop and drop in missing:        # the experts' block: a level ep takes whole is named only by `world`
            hint = (f"{RULE_HINT}; ep takes `{drop}` whole, so an experts scope holds it only as `shard over "
                    f"world`: give the experts' `{outer}` that, or leave `{drop}` out of their `{inner}`")
        diags.append(error(main.scope.span, message, hint, notes))


def warnings(mesh: Mesh, bounds: list[dict], options: dict, top: dict, diags: list[Diagnostic]) -> None:
    for b in bounds:
        own = b.get("_own")
        # The experts' block: a level ep takes whole has one rank left in the experts' mesh,
        # so a scope leaving it out is not partial (and the language forbids naming it).
        m = Mesh(tuple(lv for lv in mesh.levels if lv.name != b.get("_drop")))
        for key in STATES:
            spec, stmt = b[key]
            if stmt is None or (own is not None and key not in own):
                continue
            _partial(m, key, spec.levels, stmt.scope.span, diags)
            if key == "params" and spec.secondary is not None:
                sec = next(o for o in stmt.options if o.key == "secondary")
                _partial(m, "secondary", spec.secondary.levels, sec.span, diags)
    _ho_ring(bounds, options, top, diags)
    _accumulate(bounds, options, top, diags)


def _partial(mesh: Mesh, what: str, levels, span, diags) -> None:
    """Lins eq. 7: a scope holding an outer level should hold every level inside it."""
    names = mesh.names
    levels = tuple(lv for lv in levels if lv in names)
    if not levels:
        return
    outer = min(names.index(lv) for lv in levels)
    missing = [n for n in names[outer + 1:] if n not in levels]
    if missing:
        diags.append(warning(span, f"`{what}` shards over `{names[outer]}` but not over "
                             f"{', '.join(f'`{m}`' for m in missing)} inside it",
                             f"its collectives then cross the `{names[outer]}` links at full volume "
                             f"(Lins eq. 7); add {', '.join(missing)} or shard over inner levels only"))


def _ho_ring(bounds, options, top, diags) -> None:
    """An algorithm that pipelines pieces of multi-level stages (ho-ring), with no scope
    spanning two levels: a warning (every collective is then one stage, the ring)."""
    name = options.get("collectives")
    if name is None or name == Collectives.AUTO or algorithms.get(name).pieces == 1:
        return
    widest = 0
    for b in bounds:
        for key in STATES:
            spec = b[key][0]
            widest = max(widest, len(spec.levels))
            if key == "params" and spec.secondary is not None:
                widest = max(widest, len(spec.secondary.levels))
    if widest < 2:
        word = top["collectives"].args[0]
        diags.append(warning(word.span, f"`collectives {name}` has nothing to pipeline: no scope spans two levels",
                             f"{name} overlaps the stages of a multi-level collective; use `auto` or `ring`"))


def _accumulate(bounds, options, top, diags) -> None:
    if options.get("accumulate", 1) != 1:
        return
    for b in bounds:
        g, gstmt = b["grads"]
        o, _ = b["optim"]
        if g.levels and set(g.levels) < set(o.levels):
            stmt = top.get("accumulate") or gstmt
            span = stmt.span if stmt is top.get("accumulate") else stmt.scope.span
            given = "`accumulate 1` but" if "accumulate" in top else "`accumulate` is 1 (the default) but"
            diags.append(warning(span, f"{given} `grads` shards over a strict subset of `optim`'s levels",
                                 "partial gradient synchronisation (PaRO-IIG/NIG) only pays off with several "
                                 "micro-batches per step; set e.g. `accumulate 4`"))
            return
