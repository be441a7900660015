"""Resolution — stage 2 of the pipeline (AST -> **Strategy**).

Input: a `Program` (from `shardc.dsl.parser`), the world size if known and an optional
mesh override; output: an `ir.Strategy` (without its rendered warnings, which
`shardc.dsl.load_strategy` adds) and every diagnostic found. The cross-statement rules
(dependency rule, warnings) live in `shardc.dsl.checks`.

[Note: defaults]
A missing `params`/`grads`/`optim` statement means `replicate`; a missing `mesh` is an
error unless a mesh override is given. An `override` block is kept partial in the IR:
the states it does not mention are None (`shardc.lowering` resolves each unit's scopes).
For its dependency check, a block is checked merged over the top-level statements.
The `experts` block is the same: partial, checked merged over the top level.

[Note: ep's sizes]
`ep N` (N > 1) borrows N contiguous ranks of the innermost level, so N must divide that
level's size; `ep LEVEL` takes the whole level (ep = its size). Both are checked against
every size that is known: the resolved mesh's, or, when the mesh has an error of its own
(a product mismatch, a duplicate level), the sizes still written on it (numbers, `local`
from LOCAL_WORLD_SIZE, a DeviceMesh's dims), so one run reports both. Only a size that
depends on what failed (`*` without a world size) goes unchecked, and that is an error
already. An ep of 1 (`ep 1`, or `ep LEVEL` of a size-1 level) is no expert parallelism:
`Experts(ep=1, level="")`.

[Note: comm follows dtype]
A `params` or `grads` statement without `comm` communicates in its own `dtype`:
`params shard over world dtype bf16` all-gathers bf16 payloads (2 bytes per element),
as ZeRO, FSDP and the papers do with bf16 storage. `comm` only needs writing to send a
different width than is stored (`comm int8`, or `comm fp32` for bf16 storage).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from shardc.dsl import ast, checks
import shardc.algorithms as algorithms
from shardc.dsl.diagnostics import Diagnostic, Note, did_you_mean, error, short
from shardc.dsl.ir import (STATES, BufferSync, Collectives, DType, Experts, GradsSpec, Granularity, Mesh, MeshDims,
                           OptimSpec, Override, ParamsSpec, Scopes, Secondary, Span, Strategy, UnitsKind, UnitsSpec)
from shardc.dsl.mesh import MAX_DIGITS, MAX_SIZE, bind_mesh, check_ir_mesh, parse_int, resolve_mesh
from shardc.dsl.quantities import BUCKET_UNITS

ALLOWED = {("params", "comm"): ("int8", "bf16", "fp32"), ("params", "dtype"): ("fp32", "bf16", "fp16"),
           ("grads", "comm"): ("int4", "int8", "bf16", "fp32"), ("grads", "dtype"): ("fp32", "bf16")}
NO_COLLECTIVE = {"params": "`params replicate` never all-gathers",
                 "grads": "`grads replicate` never reduce-scatters"}
MAX_BUCKET = 2**40
_SCOPE_WORDS = {*STATES, "override", "experts", "{", "}"}   # a broken one hides a scope


@dataclass
class MeshOverride:
    """A `mesh=` override: parsed text (with its AST), a ready `ir.Mesh`, or the dims of a
    DeviceMesh the strategy's own mesh binds to."""
    tree: ast.MeshAst | None = None
    mesh: Mesh | None = None
    dims: MeshDims | None = None


@dataclass
class _Ctx:
    names: tuple[str, ...] | None       # declared level names (None: no usable mesh)
    diags: list[Diagnostic]
    origin: str = ""                    # " (mesh given by the override)" when overridden


def resolve(program: ast.Program, world_size: int | None, override: MeshOverride | None,
            default_name: str, parse_failed: bool, ep: ast.Word | None = None) -> tuple[Strategy | None, list[Diagnostic]]:
    """The Strategy of `program`, or None, and every diagnostic; `ep` (`--ep`) replaces the
    `experts` statement's ep word (an error where the program has no `experts` statement)."""
    diags: list[Diagnostic] = []
    if not program.statements and not parse_failed:
        diags.append(error(Span(program.file, 1, 1, 1, 1), "the strategy is empty",
                           "a strategy needs at least `mesh ...` and the state scopes"))
        return None, diags
    top, overrides = _index(program.statements, diags)
    mesh = _mesh(top.get("mesh"), world_size, override, diags, parse_failed, program.file)
    names = mesh.names if mesh else _declared(top.get("mesh"), override)
    origin = "" if override is None or override.dims is not None else " (the mesh comes from the override)"
    ctx = _Ctx(names, diags, origin)
    scopes, bound = _scopes(top, {}, ctx)
    ovs = [_override(o, bound, ctx) for o in overrides]
    experts, experts_bound = None, []
    if "experts" in top:
        sizes = _known_sizes(mesh, top.get("mesh"), override)
        experts, eb = _experts(top["experts"], bound, sizes, ctx, ep)
        experts_bound = [eb]
    elif ep is not None:
        diags.append(error(ep.span, f"ep {ep.text} is given, but the strategy has no `experts` statement",
                           'add `experts "PATTERN"` naming the expert parameters (e.g. "*.experts")'))
    options = _options(top, ctx)
    blocks = [bound] + [b for _, b in ovs] + experts_bound
    if names is not None and not any(_hides_scope(w) for w in program.skipped):
        for b in blocks:
            if all(b[k][0] is not None for k in STATES):
                checks.dependency(b, diags)
    if not parse_failed and not any(d.is_error for d in diags) and mesh is not None:
        checks.warnings(mesh, blocks, options, top, diags)
    if parse_failed or any(d.is_error for d in diags) or mesh is None:
        return None, diags
    lines = tuple((k, s.span.line) for k, s in sorted(top.items(), key=lambda kv: kv[1].span.line))
    return Strategy(name=options.pop("name", default_name), mesh=mesh, scopes=scopes,
                    overrides=tuple(o for o, _ in ovs), experts=experts, file=program.file, lines=lines,
                    **options), diags


def _hides_scope(word: str) -> bool:
    """A dropped line that was (or was probably meant as) a scope statement."""
    return word in _SCOPE_WORDS or did_you_mean(word, _SCOPE_WORDS) is not None


def _index(statements, diags) -> tuple[dict[str, ast.Statement], list[ast.Statement]]:
    top: dict[str, ast.Statement] = {}
    overrides: list[ast.Statement] = []
    seen_patterns: dict[str, ast.Statement] = {}
    for s in statements:
        if s.keyword == "override":
            first = seen_patterns.setdefault(s.args[0].text, s)
            if first is not s:
                diags.append(_duplicate(s, first, f"override {short(s.args[0].text, 40)}"))
            else:
                overrides.append(s)
            continue
        first = top.setdefault(s.keyword, s)
        if first is not s:
            diags.append(_duplicate(s, first, f"`{s.keyword}` statement"))
    return top, overrides


def _duplicate(s: ast.Statement, first: ast.Statement, what: str) -> Diagnostic:
    return error(s.keyword_span, f"duplicate {what}: given on lines {first.span.line} and {s.span.line}",
                 "keep only one of them", [Note(first.keyword_span, f"first given on line {first.span.line}")])


def _declared(mesh_stmt, override) -> tuple[str, ...] | None:
    if override is not None and override.dims is not None:     # the statement's names bind to the dims
        return tuple(lv.name.text for lv in mesh_stmt.mesh.levels) if mesh_stmt else override.dims.names
    if override is not None:
        m = override.mesh or override.tree
        if isinstance(m, Mesh):
            return m.names
        return tuple(lv.name.text for lv in m.levels) if m else None
    return tuple(lv.name.text for lv in mesh_stmt.mesh.levels) if mesh_stmt else None


def _mesh(stmt, world_size, override: MeshOverride | None, diags, parse_failed, file: str) -> Mesh | None:
    if override is not None and override.dims is not None:
        return bind_mesh(stmt.mesh if stmt is not None else None, override.dims, diags, file)
    if override is not None and override.mesh is not None:
        before = len(diags)
        check_ir_mesh(override.mesh, world_size, diags)
        return override.mesh if len(diags) == before else None
    if override is not None and override.tree is not None:
        return resolve_mesh(override.tree, world_size, diags, " (the mesh comes from the override)")
    if override is not None:
        return None                     # the override text did not parse; already reported
    if stmt is None:
        if parse_failed:                # the mesh line may be the one that did not parse
            return None
        # a whole-file problem points at the file's start, as rustc's missing `main` does
        diags.append(error(Span(file, 1, 1, 1, 1), "the strategy has no `mesh` statement",
                           "add one, e.g. `mesh node(*) > gpu(local)`, or pass a mesh override"))
        return None
    return resolve_mesh(stmt.mesh, world_size, diags)


def _levels(words: tuple[ast.Word, ...], ctx: _Ctx) -> tuple[str, ...] | None:
    """Scope words -> level names in mesh order; None after an error."""
    if ctx.names is None:
        return None
    if len(words) == 1 and words[0].text == "world":
        return ctx.names
    ok, seen = True, {}
    for w in words:
        if w.text not in ctx.names:
            hint = did_you_mean(w.text, ctx.names + ("world",)) or f"the mesh declares {', '.join(ctx.names)}"
            ctx.diags.append(error(w.span, f"level `{short(w.text)}` is not declared in the mesh{ctx.origin}", hint))
            ok = False
        elif w.text in seen:
            ctx.diags.append(error(w.span, f"level `{short(w.text)}` is listed twice", "list each level once",
                                   [Note(seen[w.text].span, "first listed here")]))
            ok = False
        seen.setdefault(w.text, w)
    return tuple(n for n in ctx.names if n in seen) if ok else None


def _scopes(stmts: dict, inherited: dict, ctx: _Ctx) -> tuple[Scopes, dict]:
    """Scopes from the statements given (others inherited); `bound` maps state -> (spec, stmt)."""
    bound = dict(inherited)
    for key, build in (("params", _params), ("grads", _grads), ("optim", _optim)):
        if key in stmts:
            bound[key] = (build(stmts[key], ctx), stmts[key])
        bound.setdefault(key, ({"params": ParamsSpec(), "grads": GradsSpec(), "optim": OptimSpec()}[key], None))
    valid = all(spec is not None for spec, _ in bound.values())
    scopes = Scopes(*(bound[k][0] for k in STATES)) if valid else Scopes()
    return scopes, bound


def _opts(stmt: ast.Statement, ctx: _Ctx) -> dict[str, ast.Option]:
    out: dict[str, ast.Option] = {}
    for o in stmt.options:
        first = out.setdefault(o.key, o)
        if first is not o:
            ctx.diags.append(error(o.span, f"option `{o.key}` is given twice in `{stmt.keyword}`",
                                   "keep only one", [Note(first.span, "first given here")]))
    return out


def _dtype(stmt: ast.Statement, opt: ast.Option | None, ctx: _Ctx,
           default: DType | None = DType.FP32) -> DType | None:
    if opt is None:
        return default
    allowed = ALLOWED[(stmt.keyword, opt.key)]
    value = opt.value.text
    if value not in allowed:
        ctx.diags.append(error(opt.value.span, f"`{stmt.keyword} {opt.key} {value}` is not supported",
                               f"`{stmt.keyword} {opt.key}` takes {', '.join(allowed)}"))
        return None
    if opt.key == "comm" and value != "fp32" and stmt.scope.replicate:
        ctx.diags.append(error(opt.span, f"`comm {value}` has no collective to act on: {NO_COLLECTIVE[stmt.keyword]}",
                               f"remove `comm {value}`, or shard the {stmt.keyword} (`shard over ...`)"))
        return None
    return DType(value)


def _by(stmt: ast.Statement, ctx: _Ctx) -> Granularity | None:
    """The granularity `by WORD` names (FLAT when not written); None after an error."""
    by = stmt.scope.by if stmt.scope is not None else None
    if by is None:
        return Granularity.FLAT
    words = [g.value for g in Granularity if g is not Granularity.FLAT]
    if by.text not in words:
        ctx.diags.append(error(by.span, f"unknown granularity `{by.text}` after `by`",
                               did_you_mean(by.text, words) or "write `by tensor` (whole tensors, each on one owner)"))
        return None
    if stmt.keyword != "optim":
        why = {"grads": "a tensor-owned optim scope already receives each matrix's whole reduced gradient "
                        "(one all-to-all to the owners after the grads scope's reduce-scatter), and a reduce "
                        "to each owner during the backward is not built",
               "params": "the forward needs every parameter whole on every rank of its scope, which the "
                         "flat all-gather already gives, so whole tensors on owners would change only who "
                         "sends them"}.get(stmt.keyword, f"only `optim` places its shards by {by.text}")
        ctx.diags.append(error(by.span, f"`{stmt.keyword} ... by {by.text}` is not supported: {why}",
                               f"write `optim shard over ... by {by.text}` and keep `{stmt.keyword}` "
                               f"element-wise"))
        return None
    return Granularity(by.text)


def _params(stmt: ast.Statement, ctx: _Ctx) -> ParamsSpec | None:
    levels = _levels(stmt.scope.levels, ctx) if not stmt.scope.replicate else ()
    opts = _opts(stmt, ctx)
    dtype = _dtype(stmt, opts.get("dtype"), ctx)
    comm = _dtype(stmt, opts.get("comm"), ctx, default=dtype)   # [Note: comm follows dtype]
    secondary = None
    if "secondary" in opts:
        o = opts["secondary"]
        if stmt.scope.replicate:
            ctx.diags.append(error(o.span, "`secondary` needs sharded params: with `replicate` every rank holds them all",
                                   "remove `secondary ...`, or shard the params"))
            return None
        sec_levels = _levels(o.levels, ctx)
        if sec_levels is None:
            return None
        secondary = Secondary(sec_levels, DType(o.value.text) if o.value else None)
    if levels is None or comm is None or dtype is None or _by(stmt, ctx) is None:
        return None
    return ParamsSpec(levels, secondary, comm, dtype, stmt.span.line)


def _grads(stmt: ast.Statement, ctx: _Ctx) -> GradsSpec | None:
    levels = _levels(stmt.scope.levels, ctx) if not stmt.scope.replicate else ()
    opts = _opts(stmt, ctx)
    dtype = _dtype(stmt, opts.get("dtype"), ctx)
    comm = _dtype(stmt, opts.get("comm"), ctx, default=dtype)   # [Note: comm follows dtype]
    if levels is None or comm is None or dtype is None or _by(stmt, ctx) is None:
        return None
    return GradsSpec(levels, comm, dtype, stmt.span.line)


def _optim(stmt: ast.Statement, ctx: _Ctx) -> OptimSpec | None:
    levels = _levels(stmt.scope.levels, ctx) if not stmt.scope.replicate else ()
    by = _by(stmt, ctx)
    return None if levels is None or by is None else OptimSpec(levels, stmt.span.line, by)


def _override(stmt: ast.Statement, top_bound: dict, ctx: _Ctx) -> tuple[Override, dict]:
    pattern = stmt.args[0].text[1:-1]
    if not pattern.strip():
        ctx.diags.append(error(stmt.args[0].span, "the override pattern is empty",
                               'write a glob over module names, e.g. "transformer.h.0"'))
    inner: dict[str, ast.Statement] = {}
    for s in stmt.body:
        first = inner.setdefault(s.keyword, s)
        if first is not s:
            ctx.diags.append(_duplicate(s, first, f"`{s.keyword}` statement in this override"))
    if not stmt.body:
        ctx.diags.append(error(stmt.span, f"override {short(stmt.args[0].text, 40)} sets nothing",
                               "put `params`, `grads` or `optim` lines inside the braces, or remove it"))
    scopes, bound = _scopes(inner, top_bound, ctx)
    bound = dict(bound, _label=f"override {short(stmt.args[0].text, 40)}", _own=set(inner))
    own = {k: getattr(scopes, k) for k in STATES if k in inner}
    return Override(pattern, line=stmt.span.line, **own), bound


def _known_sizes(mesh: Mesh | None, stmt: ast.Statement | None, override: MeshOverride | None) -> dict[str, int]:
    """Level name -> size, for every size known ([Note: ep's sizes])."""
    if mesh is not None:
        return {lv.name: lv.size for lv in mesh.levels}
    if override is not None and override.dims is not None:
        return dict(zip(override.dims.names, override.dims.sizes))
    if override is not None and override.mesh is not None:
        return {lv.name: lv.size for lv in override.mesh.levels if isinstance(lv.size, int) and lv.size >= 1}
    tree = override.tree if override is not None else (stmt.mesh if stmt is not None else None)
    out: dict[str, int] = {}
    for lv in tree.levels if tree is not None else ():
        text = lv.size.text
        if text == "local":
            text = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
        if text.isdigit() and len(text) <= MAX_DIGITS and 1 <= int(text) <= MAX_SIZE:
            out[lv.name.text] = int(text)
    return out


def _experts(stmt: ast.Statement, top_bound: dict, sizes: dict[str, int], ctx: _Ctx,
             ep_word: ast.Word | None = None) -> tuple[Experts, dict]:
    """The `experts` statement: its pattern, ep and level ([Note: ep's sizes]), and its
    partial block, checked like an override's plus the ep-ranks rule (`_ep_twice`);
    `ep_word` (`--ep`) stands for its ep."""
    label = f"experts {short(stmt.args[0].text, 40)}"
    pattern = stmt.args[0].text[1:-1]
    if not pattern.strip():
        ctx.diags.append(error(stmt.args[0].span, "the experts pattern is empty",
                               'write a glob over parameter and module names, e.g. "layers.*.moe.experts"'))
    ep_word = ep_word or (stmt.args[1] if len(stmt.args) > 1 else None)
    ep, level, whole = _ep(ep_word, sizes, ctx) if ep_word is not None else (1, "", "")
    inner: dict[str, ast.Statement] = {}
    for s in stmt.body:
        first = inner.setdefault(s.keyword, s)
        if first is not s:
            ctx.diags.append(_duplicate(s, first, f"`{s.keyword}` statement in this experts block"))
    if stmt.form == "block" and not stmt.body:
        ctx.diags.append(error(stmt.span, f"{label} sets nothing",
                               "put `params`, `grads` or `optim` lines inside the braces, or remove the braces "
                               "(the experts then take the top-level scopes)"))
    if whole:
        _ep_twice(inner, whole, ep_word, ctx)
    by = inner["optim"].scope.by if "optim" in inner and inner["optim"].scope is not None else None
    if by is not None:
        ctx.diags.append(error(by.span, f"the experts' optimizer states cannot be placed by {by.text} yet",
                               "drop `by ...` in the experts block: the experts keep element-wise chunks"))
    scopes, bound = _scopes(inner, top_bound, ctx)
    bound = dict(bound, _label=label, _own=set(inner), _drop=whole)
    own = {k: getattr(scopes, k) for k in STATES if k in inner}
    return Experts(pattern, ep or 1, level, line=stmt.span.line, **own), bound


def _ep(word: ast.Word, sizes: dict[str, int], ctx: _Ctx) -> tuple[int | None, str, str]:
    """`ep N` or `ep LEVEL` -> (ep, the level it borrows from, the level it takes whole or "");
    ep None after an error or when the size it needs is not known."""
    if word.text.lstrip("-").isdigit():                                # `ep N`
        n = parse_int(word, "`ep`", ctx.diags, minimum=1, maximum=MAX_SIZE,
                      hint="ep is how many ranks of the innermost level split the experts (1 = none), "
                           "or a level name for a whole level")
        if n is None or n == 1 or ctx.names is None:
            return n, "", ""
        inner = ctx.names[-1]
        size = sizes.get(inner)
        if size is not None and size % n:
            ctx.diags.append(error(word.span, f"ep {n} does not divide level `{short(inner)}` (size {size}), the "
                                   f"innermost level it borrows its ranks from{ctx.origin}",
                                   f"use a divisor of {size}, or `ep {short(inner)}` for the whole level"))
            return None, "", ""
        return n, inner, inner if size == n else ""
    levels = _levels((word,), ctx)
    if levels is None:
        return None, "", ""
    size = sizes.get(word.text)
    if size == 1:
        return 1, "", ""
    return size, word.text, word.text


def _ep_twice(inner: dict[str, ast.Statement], whole: str, ep_word: ast.Word, ctx: _Ctx) -> None:
    """A block scope naming the level ep takes whole: its ranks would hold the experts twice
    (`world` is fine: over the experts' mesh that level has size 1). `secondary` is exempt."""
    for key in STATES:
        if key not in inner:
            continue
        for w in inner[key].scope.levels:
            if w.text == whole:
                ctx.diags.append(error(
                    w.span, f"the experts' `{key}` shard over `{short(whole)}`, whose ranks ep already splits "
                    f"the experts over (ep {short(ep_word.text)}): a scope cannot include the ep ranks twice",
                    f"drop `{short(whole)}` from the experts' `{key}`: their data-parallel ranks are the other "
                    f"levels'"))


# [Note: buffers of a mixture-of-experts strategy]
# A strategy with an `experts` statement and no `buffers` line keeps each rank's buffers
# (`buffers local`, FSDP2's behaviour, which torchtitan's MoE training assumes), not rank
# 0's before every forward: a MoE's load-balancing counters (DeepSeek-V3's tokens per
# expert) add up every micro-batch's tokens on each rank and are summed over the ranks at
# the step (torchtitan's optimizer pre-hook); broadcasting rank 0's before each forward
# would drop the other ranks' earlier micro-batches, silently (bench/clients/torchtitan_moe_check.py).
def _options(top: dict[str, ast.Statement], ctx: _Ctx) -> dict:
    out: dict = {}
    d = ctx.diags
    if "strategy" in top:
        out["name"] = top["strategy"].args[0].text
    if "accumulate" in top:
        out["accumulate"] = parse_int(top["accumulate"].args[0], "`accumulate`", d, minimum=1, maximum=1_000_000,
                                      hint="accumulate counts micro-batches per optimizer step (1 = none)")
    if "prefetch" in top:
        out["prefetch"] = parse_int(top["prefetch"].args[0], "`prefetch`", d, minimum=0, maximum=1024,
                                    hint="prefetch counts units gathered ahead of use (0 = no overlap)")
    if "collectives" in top:
        out["collectives"] = _algorithm(top["collectives"].args[0], d)
    if "buffers" in top:
        out["buffers"] = BufferSync(top["buffers"].args[0].text)
    elif "experts" in top:         # [Note: buffers of a mixture-of-experts strategy]
        out["buffers"] = BufferSync.LOCAL
    if "units" in top:
        out["units"] = _units(top["units"], ctx)
    if "bucket" in top:
        out["bucket"] = _bucket(top["bucket"], ctx)
    return out


def _algorithm(word: ast.Word, diags) -> Collectives | None:
    """`collectives NAME`: `auto` or an algorithm `shardc.algorithms` registers."""
    known = (algorithms.AUTO, *algorithms.names())
    if word.text in known:
        return Collectives(word.text)
    diags.append(error(word.span, f"unknown collectives algorithm `{word.text}`",
                       did_you_mean(word.text, known) or f"choose {', '.join(known[:-1])} or {known[-1]}"))
    return None


def _units(stmt: ast.Statement, ctx: _Ctx) -> UnitsSpec | None:
    if stmt.form == "auto":
        return UnitsSpec(UnitsKind.AUTO, (), stmt.span.line)
    if stmt.form == "type":
        return UnitsSpec(UnitsKind.TYPE, tuple(w.text for w in stmt.args), stmt.span.line)
    patterns = tuple(w.text[1:-1] for w in stmt.args)
    for w, p in zip(stmt.args, patterns):
        if not p.strip():
            ctx.diags.append(error(w.span, "a unit pattern is empty", 'write a glob such as "transformer.h.*"'))
    return UnitsSpec(UnitsKind.PATTERNS, patterns, stmt.span.line)


def _bucket(stmt: ast.Statement, ctx: _Ctx) -> int | None:
    number, *unit = stmt.args
    mult = 1
    if unit:
        u = unit[0]
        if u.text not in BUCKET_UNITS:
            ctx.diags.append(error(u.span, f"unknown size unit `{short(u.text)}`",
                                   did_you_mean(u.text, BUCKET_UNITS) or f"units are {', '.join(BUCKET_UNITS)}"))
            return None
        mult = BUCKET_UNITS[u.text]
    n = parse_int(number, "`bucket`", ctx.diags, minimum=0, maximum=MAX_BUCKET,
                  hint="bucket is a size such as `25MB`, or 0 for no bucketing; leave the line out for "
                       "the cost model's choice")
    if n is None:
        return None
    if n * mult > MAX_BUCKET:
        ctx.diags.append(error(stmt.span, f"`bucket` {n}{unit[0].text} is larger than 1 TiB",
                               "buckets fuse small units' collectives; a few MB is typical"))
        return None
    return n * mult
