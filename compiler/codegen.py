"""Codegen — compiler stage `codegen` (Plan + scheduled graph -> Python source).

Input: a `Plan`, the scheduled GraphModule it came from, the model's class name.
Output: the text of a standalone Python module (deterministic: same inputs, same
bytes) exposing `shard_model(model) -> ShardedModule`; `compile()`s.

Logic lives here in view-models; `templates/sharded_module.py.jinja` only loops and
branches (StrictUndefined).

[Note: fx vs export emission]
fx capture: the module defines `forward(sm, ...)`, the captured graph's code with the
runtime calls in place, each collective-bearing line commented with the strategy line
that caused it; `shard_model` passes `hooks=False` and binds that forward. Export
capture (models with Python control flow, e.g. Hugging Face): the aten graph is not
readable Python, so the model keeps its own forward, driven by the runtime's module
hooks (`hooks=True`). The header says which.

[Note: the emitted plan]
Both kinds print the lowered plan (`shardc.lowering`): UNITS as literals, every
collective row of every unit with the strategy line that causes it (comments: what the
ledger will record), PLAN_PASSES (the plan passes that ran: `shard_model` lowers UNITS
with exactly these unless handed the Plan's `Lowering`, which `shardc.compile` hands over)
and SCHEDULE, the `Schedule` the runtime follows, `shard_model`'s default `schedule=`
passed to `shard_module`. SCHEDULE holds exactly what the engine reads.
On the hooks path that is the forward and the backward stages. With fx capture the
forward stages are the emitted forward's `rt.issue_gather` calls (placed by the
`schedule_overlap` pass from the same plan), so SCHEDULE has `forward=()` and holds the
backward stages only; nothing printed is dead. Editing SCHEDULE (or the fx forward's
issue calls) changes the run.
"""
from __future__ import annotations

import os
import pprint
from dataclasses import dataclass, replace
from functools import lru_cache

import jinja2

from shardc.compiler.emit_graph import graph_code
from shardc.compiler.passes.meta import Call, info
from shardc.compiler.plan import Plan
from shardc.dsl.ir import STATES, Scopes, Strategy
from shardc.dsl.unparse import state_clause, state_text
from shardc.lowering import Phase, kinds_of

__all__ = ["emit", "statement"]

TEMPLATE = "sharded_module.py.jinja"


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    loader = jinja2.FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates"))
    return jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                              trim_blocks=True, lstrip_blocks=True, autoescape=False)


def _source_line(strategy: Strategy, line: int) -> str | None:
    try:
        with open(strategy.file, encoding="utf-8") as f:
            text = f.read().splitlines()[line - 1]
    except (OSError, IndexError):
        return None
    return " ".join(text.split("#", 1)[0].split()) or None


def statement(strategy: Strategy, line: int, fallback: str) -> str:
    """`file.shard:LINE <statement>` for a comment in the emitted code (`<statement> (default)` if unwritten)."""
    if not line:
        return f"{fallback} (default)"
    text = _source_line(strategy, line)
    return f"{os.path.basename(strategy.file)}:{line} {text or fallback}"


@dataclass(frozen=True, slots=True)
class _Commenter:
    plan: Plan

    def stmt(self, scopes: Scopes, state: str) -> str:
        s = self.plan.strategy
        spec = getattr(scopes, state)
        return statement(s, spec.line, state_text(state, spec, s.mesh))

    def __call__(self, node) -> str:
        meta = info(node)
        if meta is None or meta.op is Call.COMPUTE:
            return ""
        s, unit = self.plan.strategy, self.plan.units[meta.unit]
        sc = unit.scopes
        if meta.op in (Call.BEGIN_FORWARD, Call.END_FORWARD):
            return self.stmt(sc, "params") + (" (root unit)" if meta.line else "") if meta.line else ""
        if meta.op is Call.ISSUE_GATHER:
            pre = f"; {statement(s, s.line_of('prefetch'), f'prefetch {s.prefetch}')}" if s.prefetch else ""
            return self.stmt(sc, "params") + pre
        if meta.op in (Call.WAIT_GATHER, Call.RELEASE):
            return self.stmt(sc, "params")
        return self._backward(meta.unit)

    def _backward(self, unit: int) -> str:
        """The unit's backward and step collectives, named by the plan's rows."""
        sc = self.plan.units[unit].scopes
        rows = [r for g in self.plan.lowering.units[unit].groups for r in g.rows]
        parts = []
        for phase, state, what in ((Phase.BACKWARD, "params", "backward re-gather"),
                                   (Phase.BACKWARD, "grads", "backward reduce-scatter"),
                                   (Phase.SYNC, "optim", "step sync")):
            if any(r.phase is phase and r.state == state for r in rows):
                parts.append(f"{self.stmt(sc, state)} ({what})")
        return "; ".join(parts)


def _pformat(obj, indent: int = 0) -> str:
    text = pprint.pformat(obj, width=110 - indent, sort_dicts=False)
    return text.replace("\n", "\n" + " " * indent)


def _strategy_for_emission(s: Strategy) -> Strategy:
    return replace(s, file=os.path.basename(s.file), warnings=())


def _unit_reprs(plan: Plan) -> list[str]:
    out = []
    for u in plan.units:
        scopes = "STRATEGY.scopes" if u.scopes == plan.strategy.scopes else _pformat(u.scopes, 8)
        params = "".join(f"        {p!r},\n" for p in u.params)
        out.append(f"UnitSpec({u.name!r}, modules={u.modules!r}, scopes={scopes}, params=(\n{params}    ))")
    return out


def _bucket_line(s: Strategy) -> str:
    size = f"{s.bucket:,} bytes" if s.bucket else "0 (no units merged)"
    line = s.line_of("bucket")
    why = f"{os.path.basename(s.file)}:{line}" if line else "chosen by the cost model, no `bucket` line"
    return f"bucket {size}  ({why}; analysis/costmodel/bucketing.py resolve_bucket)"


def _header(plan: Plan, model_class: str) -> list[str]:
    s = plan.strategy
    lines = [f"{model_class} sharded under strategy `{s.name}` ({os.path.basename(s.file)}), emitted by shardc.",
             "", f"mesh        {s.mesh}   (world {s.mesh.world})"]
    for state in STATES:
        spec = getattr(s.scopes, state)
        where = f"{os.path.basename(s.file)}:{spec.line}" if spec.line else "default"
        lines.append(f"{state:<11} {state_clause(spec, s.mesh)}  (s={s.factor(spec.levels)}, {where})")
    lines.append(f"accumulate {s.accumulate}, prefetch {s.prefetch}, collectives {s.collectives.value}, "
                 f"capture {plan.capture}")
    lines.append(f"plan passes {', '.join(plan.passes) or 'none'} (shardc.lowering.passes)")
    lines.append(_bucket_line(s))
    if plan.backend == "inductor":
        lines += ["", "Backend inductor (the whole-step compiled mode): each micro-batch's forward and backward",
                  "are one Inductor graph, the plan's collectives in it as functional collectives, and the",
                  "step's sync and update one more graph at opt.step(). The compiled graphs issue the gathers",
                  "where SCHEDULE below says (runtime/graph/backend.py); Inductor's own collective passes are",
                  "off; sm.runtime.collectives() lists what each compiled graph issues, in order."]
    elif plan.capture == "export":
        lines += ["", "Export capture: the model keeps its own forward, driven by the runtime's module hooks",
                  "(hooks=True), which follow SCHEDULE below (units in the exported graph's order)."]
    lines += ["", "units (forward order):", f"  {'#':>3}  {'name':<28} {'params':>6} {'elements':>12}  params | grads | optim"]
    for i, u in enumerate(plan.units):
        lv = " | ".join(",".join(getattr(u.scopes, st).levels) or "-" for st in STATES)
        lines.append(f"  {i:>3}  {u.name:<28} {len(u.params):>6} {plan.unit_numels[i]:>12,}  {lv}")
    lines += [f"note: {n}" for n in plan.notes]
    return lines


def _stage_line(plan: Plan, stage, c: "_Commenter") -> str:
    s, unit = plan.strategy, plan.units[stage.unit]
    why = []
    if stage.unit in stage.issue:
        why.append(c.stmt(unit.scopes, "params"))
    if any(j != stage.unit for j in stage.issue):
        why.append(statement(s, s.line_of("prefetch"), f"prefetch {s.prefetch}"))
    return f"{stage!r}," + (f"  # {'; '.join(why)}" if why else "")


def _cause(plan: Plan, c: "_Commenter", u, g, r, kinds: dict) -> str:
    """The strategy line behind row `r`: the unit's scope's, or, for a group a strategy
    statement places (`kinds`: its placement kinds by `Over`; the `experts` statement), its
    placement's scope and that statement."""
    k = kinds.get(g.placement.over)
    text = k.statement() if k is not None else None
    if text is None:
        return c.stmt(u.scopes, r.state)
    return c.stmt(g.placement.scopes, r.state) + "; " + statement(plan.strategy, k.line, text)


def _row_lines(plan: Plan, c: "_Commenter") -> list[str]:
    out, kinds = [], {k.over: k for k in kinds_of(plan.strategy)}
    for i, (u, up) in enumerate(zip(plan.units, plan.lowering.units)):
        for g in up.groups:
            kind = "trainable" if g.trainable else "frozen"
            for r in g.rows:
                out.append(f"{i:>3} {kind:<9} {r.phase.value:<8} {r.op.value:<14} {','.join(r.levels):<14} "
                           f"{r.bytes:>12,} B per {r.per.value:<8}  {_cause(plan, c, u, g, r, kinds)}")
    for r in plan.lowering.clip_rows:
        out.append(f"  * {'':<9} {r.phase.value:<8} {r.op.value:<14} {','.join(r.levels):<14} "
                   f"{r.bytes:>12,} B per {r.per.value:<8}  clip_grad_norm_ (optim chunks' squared norm)")
    return out


def emit(plan: Plan, gm, model_class: str) -> str:
    """The emitted module's source text (see the module note)."""
    fx_mode = plan.capture == "fx" and plan.backend == "eager"      # the whole-step mode runs the model's own
    params, body, imports = (), [], ()
    c = _Commenter(plan)
    if fx_mode:
        code = graph_code(gm, c)
        params, imports = code.params, code.imports
        body = [ln.code + (f"  # {ln.comment}" if ln.comment else "") for ln in code.lines]
    view = dict(
        header=_header(plan, model_class),
        imports=[m for m in imports if m not in ("builtins",)],
        fx=fx_mode,
        strategy=_pformat(_strategy_for_emission(plan.strategy), len("STRATEGY = ")),
        units=_unit_reprs(plan),
        params=[repr(p) for p in plan.params],
        forward_stages=[] if fx_mode else [_stage_line(plan, st, c) for st in plan.lowering.schedule.forward],
        backward_stages=[_stage_line(plan, st, c) for st in plan.lowering.schedule.backward],
        rows=_row_lines(plan, c),
        sync_early=repr(plan.lowering.schedule.sync_early) if plan.lowering.schedule.sync_early else "",
        update_deferred=repr(plan.lowering.schedule.update_deferred) if plan.lowering.schedule.update_deferred else "",
        plan_passes=repr(tuple(plan.passes)),
        backend=repr(plan.backend),
        inductor=plan.backend == "inductor",
        forward_params=", ".join(("sm",) + tuple(params)),
        body=body,
    )
    return _env().get_template(TEMPLATE).render(**view)
