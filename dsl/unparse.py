"""Unparser — the inverse of stages 1–2 (**Strategy -> `.shard` text**).

Input: an `ir.Strategy` (loaded, or built in code, e.g. with `dataclasses.replace`);
output: the text of a `.shard` file that `load_strategy` reads back into an equal
Strategy, source positions aside (`line` fields, `lines`, `file`, `warnings`). The one
place that writes strategy text: `shardc plan -o` and the emitted module's comments go
through it (the benchmark hands `shardc.compile` a replaced Strategy, no text at all).

[Note: canonical form]
Statements come in a fixed order, one per line: `strategy`, `mesh` (sizes resolved),
`params`, `grads`, `optim` (keywords padded to one width), `accumulate`, `prefetch`,
`collectives`, then `units` unless it is `auto`, `buffers` unless it is the default (`broadcast`; `local` with an
`experts` statement), `bucket` when set (in the largest
unit that divides it exactly), then the overrides, then `experts`. A scope over every level of a
multi-level mesh is written `shard over world`. Options are written only where they
differ from the default (`dtype` fp32, `comm` equal to `dtype`, no `secondary`); `comm` is never written
on a replicated state, which has no collective for it to act on (the DSL rejects
it there, so no loaded Strategy carries one).

[Note: override blocks]
An override is partial in the IR: a state the block does not mention is None, and the
block is written with exactly the states it sets (`Override.sets()`), so it reads back
the same. A block that sets nothing (built in code) cannot be written: the language
rejects an empty block, so the unparser raises a ShardcError naming its pattern.

[Note: the experts statement]
`experts "PATTERN"`, then `ep LEVEL` when ep is that level's size, `ep N` when it is a
part of the innermost level, nothing when ep is 1; then the block with the states it
sets (no braces when it sets none). A block scope holding the level ep takes whole is
written `shard over world`, the one way the language lets a block scope include it;
one that holds it without every level cannot be written, nor can an ep the language
could not have resolved (ep 1 with a level, a part of a level other than the innermost,
a part that does not divide it): each is a ShardcError.
"""
from __future__ import annotations

import re

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import STATES, BufferSync, DType, Experts, Mesh, Scopes, Strategy, UnitsKind
from shardc.dsl.mesh import MAX_DIGITS
from shardc.dsl.quantities import whole_bytes

__all__ = ["unparse", "scope_text", "state_clause", "state_text"]

_WIDTH = max(len(s) for s in STATES)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def scope_text(levels: tuple[str, ...], mesh: Mesh, whole: str = "") -> str:
    """`replicate`, `shard over world` or `shard over a, b`. `whole`: the level an experts'
    ep takes whole, which an experts scope may hold only as `world`."""
    if not levels:
        return "replicate"
    if tuple(levels) == mesh.names and (len(levels) > 1 or whole in levels):
        return "shard over world"
    if whole in levels:
        raise ShardcError(f"the experts' scope over {', '.join(levels)} cannot be written in a .shard file: it "
                          f"holds `{whole}`, which ep takes whole, without every other level (only `shard over "
                          f"world` can include it)")
    return "shard over " + ", ".join(levels)


def state_clause(spec, mesh: Mesh, whole: str = "") -> str:
    """What follows the `params`/`grads`/`optim` keyword: the scope and its options
    (`whole`: see `scope_text`)."""
    text = scope_text(spec.levels, mesh, whole)
    if getattr(spec, "owned", False) and spec.levels:
        text += f" by {spec.granularity.value}"
    sec = getattr(spec, "secondary", None)
    if sec is not None:
        text += f" secondary {', '.join(sec.levels)}" + (f" {sec.quant.value}" if sec.quant else "")
    comm, dtype = getattr(spec, "comm", DType.FP32), getattr(spec, "dtype", DType.FP32)
    if comm is not dtype and spec.levels:
        text += f" comm {comm.value}"
    if dtype is not DType.FP32:
        text += f" dtype {dtype.value}"
    return text


def state_text(state: str, spec, mesh: Mesh) -> str:
    """One state statement, e.g. `params shard over gpu comm int8`."""
    return f"{state} {state_clause(spec, mesh)}"


def unparse(s: Strategy) -> str:
    """The strategy as `.shard` text (see the module notes), ending in a newline."""
    _check_names((s.name,), "strategy name")
    _check_names(s.mesh.names, "level")
    lines = [f"strategy {s.name}", f"mesh {s.mesh}"]
    lines += _scope_lines(s.scopes, s.mesh, STATES)
    lines += [f"accumulate {s.accumulate}", f"prefetch {s.prefetch}", f"collectives {s.collectives.value}"]
    if s.units.kind is UnitsKind.PATTERNS:
        lines.append("units " + ", ".join(_quoted(p, "unit pattern") for p in s.units.names))
    elif s.units.kind is UnitsKind.TYPE:
        _check_names(s.units.names, "unit type")
        lines.append("units type " + ", ".join(s.units.names))
    default = BufferSync.LOCAL if s.experts is not None else BufferSync.BROADCAST   # resolve.py's rule
    if s.buffers is not default:                  # the default is left out
        lines.append(f"buffers {s.buffers.value}")
    if s.bucket is not None:
        lines.append(f"bucket {_size(s.bucket)}")
    for o in s.overrides:                        # partial: only the states the block sets
        if not o.sets():
            raise ShardcError(f"override {o.pattern!r} sets no state, so it cannot be written in a .shard file: "
                              f"give it params, grads or optim, or leave it out")
        lines.append(f"override {_quoted(o.pattern, 'override pattern')} {{")
        lines += [f"    {k:<{_WIDTH}} {state_clause(getattr(o, k), s.mesh)}" for k in o.sets()]
        lines.append("}")
    if s.experts is not None:
        lines += _experts_lines(s.experts, s.mesh)
    return "\n".join(lines) + "\n"


def _experts_lines(e: Experts, mesh: Mesh) -> list[str]:
    """[Note: the experts statement]"""
    head, whole = f"experts {_quoted(e.pattern, 'experts pattern')}", ""
    size = mesh.size(e.level) if e.level in mesh.names else None
    if e.ep == 1 and not e.level:
        pass
    elif size is not None and e.ep == size and e.ep > 1:
        head, whole = f"{head} ep {e.level}", e.level
    elif size is not None and e.ep > 1 and e.level == mesh.names[-1] and size % e.ep == 0:
        head += f" ep {e.ep}"
    else:
        raise ShardcError(f"experts {e.pattern!r} with ep {e.ep!r} over level {e.level!r} cannot be written in a "
                          f".shard file: ep is 1 with no level, a whole level, or a divisor of the innermost "
                          f"level's size ({mesh})")
    if not e.sets():
        return [head]
    return [head + " {"] + [f"    {k:<{_WIDTH}} {state_clause(getattr(e, k), mesh, whole)}" for k in e.sets()] + ["}"]


def _scope_lines(scopes: Scopes, mesh: Mesh, states) -> list[str]:
    return [f"{k:<{_WIDTH}} {state_clause(getattr(scopes, k), mesh)}" for k in states]


def _size(n: int) -> str:
    """Bytes in the largest unit that divides them exactly (`25MB`, `2MiB`, `100B`; 0: `0`)."""
    if n == 0:
        return "0"
    count, unit = whole_bytes(n)
    if len(str(count)) > MAX_DIGITS:
        raise ShardcError(f"bucket size {n} cannot be written in a .shard file: a number has at most "
                          f"{MAX_DIGITS} digits and no size unit divides it")
    return f"{count}{unit}"


def _check_names(names, what: str) -> None:
    from shardc.dsl.parser import keywords      # lark: loaded only when a name is checked
    for n in names:
        if not _NAME.fullmatch(n) or n in keywords():
            raise ShardcError(f"{what} {n!r} cannot be written in a .shard file: a name is letters, digits and "
                              f"`_`, not starting with a digit, and not a keyword of the language")


def _quoted(text: str, what: str) -> str:
    from shardc.dsl.parser import is_control
    if '"' in text or not text.strip() or "\n" in text or any(map(is_control, text)):
        raise ShardcError(f"{what} {text!r} cannot be written in a .shard file: it must be non-empty, "
                          f"without `\"` and without control characters")
    return f'"{text}"'
