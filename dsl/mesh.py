"""Mesh resolution — part of stage 2 (AST -> **Strategy**): `MeshAst` -> `ir.Mesh`.

Input: the mesh statement's AST (from the file or a `mesh=` override), the world size
if known; output: an `ir.Mesh` with every size an integer, plus diagnostics.

Checks: unique level names, sizes positive and not absurd, at most one `*`, `*`
inferred from the world size (which it must divide), product equal to the world size
when that is known. `local` is LOCAL_WORLD_SIZE, else the visible CUDA devices, else 1;
the two fallbacks are assumptions and say so in a warning.

[Note: binding to a DeviceMesh]
With `mesh=` a DeviceMesh (its dims as `MeshDims`), the strategy's levels bind to the
dims by name, outermost first: every level must be a dim, every dim a level, in the same
order; a level's size is the dim's (`*` and `local` resolve to it, never to the world size
or LOCAL_WORLD_SIZE, so a shipped strategy such as `node(*) > gpu(local)` runs on any
sub-mesh); a written size must equal the dim's. Each mismatch is one error naming both
sides.
"""
from __future__ import annotations

import os
from math import prod

from shardc.dsl import ast
from shardc.dsl.diagnostics import Diagnostic, Note, error, short, warning
from shardc.dsl.ir import Level, Mesh, MeshDims

MAX_SIZE = 1 << 20          # no mesh level has more than a million members
MAX_LEVELS = 16             # hardware hierarchies have a handful of levels (node > gpu > die ...)
MAX_DIGITS = 12


def parse_int(word: ast.Word, what: str, diags: list[Diagnostic], *, minimum: int,
              maximum: int, hint: str | None = None) -> int | None:
    """`word` as an int in [minimum, maximum], or None after adding an error."""
    digits = word.text.lstrip("-")
    if len(digits) > MAX_DIGITS:
        shown = word.text if len(word.text) <= 16 else word.text[:12] + "..."
        diags.append(error(word.span, f"{what} {shown} is too large ({len(digits)} digits); "
                           f"the maximum is {maximum}", hint))
        return None
    value = int(word.text)
    if value < minimum:
        diags.append(error(word.span, f"{what} must be at least {minimum}, got {value}", hint))
        return None
    if value > maximum:
        diags.append(error(word.span, f"{what} {value} is too large; the maximum is {maximum}", hint))
        return None
    return value


def resolve_mesh(m: ast.MeshAst, world_size: int | None, diags: list[Diagnostic],
                 origin: str = "") -> Mesh | None:
    """Sizes resolved, checks applied; None when an error was added."""
    before = _n_errors(diags)
    _unique_names(m, diags)
    sizes, stars = {}, []
    for lv in m.levels:
        s = lv.size.text
        if s == "*":
            stars.append(lv)
        elif s == "local":
            sizes[lv] = _local(lv, diags)
        else:
            sizes[lv] = parse_int(lv.size, f"the size of level `{short(lv.name.text)}`", diags,
                                  minimum=1, maximum=MAX_SIZE,
                                  hint="a level size is a positive whole number, `*` or `local`")
    if len(stars) > 1:
        diags.append(error(stars[1].size.span, "at most one level size may be `*`",
                           "give every other level an explicit size",
                           [Note(stars[0].size.span, "the first `*` is here")]))
    if _n_errors(diags) > before:
        return None
    known = prod(sizes.values())
    if stars:
        sizes[stars[0]] = _infer_star(m, stars[0], known, world_size, diags, origin)
        if sizes[stars[0]] is None:
            return None
    elif world_size is not None and known != world_size:
        shown = " × ".join(str(sizes[lv]) for lv in m.levels)
        diags.append(error(m.span, f"the mesh has {shown} = {known} ranks but the world size is {world_size}",
                           f"change the sizes so their product is {world_size}, or use `*` for one level"
                           + origin))
        return None
    return Mesh(tuple(Level(lv.name.text, sizes[lv]) for lv in m.levels))


def _n_errors(diags) -> int:
    return sum(1 for d in diags if d.is_error)


def _unique_names(m: ast.MeshAst, diags) -> None:
    seen: dict[str, ast.LevelDecl] = {}
    for lv in m.levels:
        first = seen.setdefault(lv.name.text, lv)
        if first is not lv:
            diags.append(error(lv.name.span, f"mesh level `{short(lv.name.text)}` is declared twice",
                               "give each level a different name",
                               [Note(first.name.span, "first declared here")]))


def _infer_star(m, star: ast.LevelDecl, known: int, world_size, diags, origin) -> int | None:
    if world_size is None:
        env = os.environ.get("WORLD_SIZE", "")
        world_size = int(env) if env.isdigit() and int(env) > 0 else None
    if world_size is None:
        diags.append(error(star.size.span, f"the size of level `{short(star.name.text)}` is `*` but the world size is unknown",
                           "pass --world N (or world_size=N), or run under torchrun"))
        return None
    if world_size % known:
        diags.append(error(star.size.span, f"the world size {world_size} is not divisible by {known}, "
                           f"the product of the other levels, so `{short(star.name.text)}(*)` cannot be inferred",
                           f"use a world size that is a multiple of {known}" + origin))
        return None
    return world_size // known


def _local(lv: ast.LevelDecl, diags) -> int | None:
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is not None and env.strip():
        if env.strip().isdigit() and 0 < int(env) <= MAX_SIZE:
            return int(env)
        diags.append(error(lv.size.span, f"`local` reads LOCAL_WORLD_SIZE, which is {env[:20]!r}, not a positive integer",
                           "set LOCAL_WORLD_SIZE to the number of ranks per node"))
        return None
    n = _cuda_devices()
    source = f"torch.cuda.device_count() = {n}" if n > 0 else "no CUDA device is visible"
    n = max(n, 1)
    diags.append(warning(lv.size.span, f"`{short(lv.name.text)}(local)` assumed to be {n}: LOCAL_WORLD_SIZE is not set and {source}",
                         "set LOCAL_WORLD_SIZE (torchrun does) or write the size"))
    return n


def _cuda_devices() -> int:
    try:
        import torch
        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no torch / broken driver: assume no GPU
        return 0


def bind_mesh(m: ast.MeshAst | None, dims: MeshDims, diags: list[Diagnostic], file: str) -> Mesh | None:
    """The strategy's mesh bound to a DeviceMesh's dims (see [Note: binding to a DeviceMesh]);
    None when an error was added. No mesh statement: the dims are the mesh."""
    sizes = dict(zip(dims.names, dims.sizes))
    if m is None:
        return Mesh(tuple(Level(n, s) for n, s in sizes.items()))
    before = _n_errors(diags)
    _unique_names(m, diags)
    names = tuple(lv.name.text for lv in m.levels)
    for lv in m.levels:
        n = lv.name.text
        if n not in sizes:
            diags.append(error(lv.name.span, f"level `{short(n)}` is not a dim of the DeviceMesh, whose dims "
                               f"are {dims}", "name the levels after the DeviceMesh's dims "
                               "(mesh_dim_names), or pass the sub-mesh of these levels"))
        elif lv.size.text not in ("*", "local") and lv.size.text != str(sizes[n]):
            diags.append(error(lv.size.span, f"level `{short(n)}` has size {lv.size.text} here, but the "
                               f"DeviceMesh's dim `{short(n)}` has {sizes[n]}",
                               "write `*` or the DeviceMesh's size"))
    extra = [n for n in dims.names if n not in names]
    if extra:
        diags.append(error(m.span, f"the DeviceMesh has dim `{short(extra[0])}`, which the mesh statement "
                           f"does not declare (DeviceMesh dims: {dims})",
                           "pass the sub-mesh of the data-parallel dims, e.g. world_mesh[\"node\", \"gpu\"]"))
    elif _n_errors(diags) == before and names != dims.names:
        diags.append(error(m.span, f"the mesh statement lists its levels as {', '.join(names)}, but the "
                           f"DeviceMesh's dims are ordered {', '.join(dims.names)}",
                           "list the levels outermost first, as the DeviceMesh's dims are"))
    if _n_errors(diags) > before:
        return None
    return Mesh(tuple(Level(n, sizes[n]) for n in names))


def check_ir_mesh(mesh: Mesh, world_size: int | None, diags) -> None:
    """A `mesh=` given as an `ir.Mesh` object: names unique, sizes positive, product = world."""
    names = [lv.name for lv in mesh.levels]
    if not names:
        diags.append(error(None, "the mesh override has no levels"))
    if len(set(names)) != len(names):
        diags.append(error(None, f"the mesh override {mesh} declares a level twice"))
    for lv in mesh.levels:
        if not isinstance(lv.size, int) or lv.size < 1:
            diags.append(error(None, f"the mesh override {mesh} has a level size that is not a positive integer"))
            return
    if world_size is not None and mesh.world != world_size:
        diags.append(error(None, f"the mesh override {mesh} has {mesh.world} ranks but the world size is {world_size}"))
