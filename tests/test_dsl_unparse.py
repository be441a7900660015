"""dsl/unparse: Strategy -> `.shard` text -> Strategy is the identity (source positions aside).

Hypothesis builds random valid strategies straight in the IR (meshes of 1–4 levels,
scopes obeying the dependency rule, every option, units, bucket, overrides, an `experts`
statement with any valid ep and a partial block), unparses
them, loads the text and compares; the twelve shipped examples and a file with stacked
overrides go through the same round trip from real text.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardc.algorithms as algorithms
from shardc.dsl import ShardcError, load_strategy, unparse
from shardc.dsl.ir import (DEPENDENCY, STATES, BufferSync, Collectives, DType, Experts, GradsSpec, Granularity, Level, Mesh, OptimSpec,
                           Override, ParamsSpec, Scopes, Secondary, Strategy, UnitsKind, UnitsSpec)
from shardc.dsl.mesh import MAX_DIGITS
from shardc.dsl.parser import keywords
from shardc.dsl.quantities import BUCKET_UNITS
from shardc.dsl.resolve import ALLOWED, MAX_BUCKET

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples" / "strategies").glob("*.shard"))
assert len(EXAMPLES) == 12, EXAMPLES     # the twelve named strategies; an empty glob must not skip
ROUND_TRIP = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.too_slow])


def positionless(s: Strategy) -> Strategy:
    """`s` without what only the source text knows (line numbers, file, rendered warnings)."""
    def scopes(sc: Scopes) -> Scopes:
        return Scopes(replace(sc.params, line=0), replace(sc.grads, line=0), replace(sc.optim, line=0))
    def block(o):
        return replace(o, line=0, **{k: replace(getattr(o, k), line=0) for k in o.sets()})
    return replace(s, scopes=scopes(s.scopes), units=replace(s.units, line=0), file="", lines=(), warnings=(),
                   overrides=tuple(block(o) for o in s.overrides),
                   experts=block(s.experts) if s.experts is not None else None)


def round_trip(s: Strategy) -> Strategy:
    text = unparse(s)
    back = load_strategy(text)
    assert positionless(back) == positionless(s), text
    assert unparse(back) == text           # the canonical form is a fixed point
    return back


# --- random valid strategies, built in the IR ------------------------------------------------

NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True).filter(lambda n: n not in keywords())
PATTERNS = st.text(st.characters(blacklist_categories=("Cc", "Cs"), blacklist_characters='"'),
                   min_size=1, max_size=12).filter(str.strip)


def dtypes(state: str, option: str):
    return st.sampled_from([DType(v) for v in ALLOWED[(state, option)]])


@st.composite
def meshes(draw) -> Mesh:
    names = draw(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    return Mesh(tuple(Level(n, draw(st.integers(1, 8))) for n in names))


@st.composite
def scopes(draw, mesh: Mesh) -> Scopes:
    # Each level joins no scope, optim only, grads and optim, or all three: the dependency rule.
    pick = [draw(st.integers(0, 3)) for _ in mesh.names]
    p, g, o = (tuple(n for n, c in zip(mesh.names, pick) if c >= k) for k in (3, 2, 1))
    secondary = None
    if p and draw(st.booleans()):
        levels = draw(st.lists(st.sampled_from(mesh.names), min_size=1, unique=True))
        secondary = Secondary(mesh.ordered(levels), draw(st.sampled_from([None, DType.INT8, DType.INT4])))
    pd, gd = draw(dtypes("params", "dtype")), draw(dtypes("grads", "dtype"))
    # A replicated state has no collective: its comm is its dtype (DSL: comm follows dtype).
    return Scopes(
        ParamsSpec(p, secondary, draw(dtypes("params", "comm")) if p else pd, pd),
        GradsSpec(g, draw(dtypes("grads", "comm")) if g else gd, gd),
        OptimSpec(o, granularity=draw(st.sampled_from(Granularity)) if o else Granularity.FLAT))


@st.composite
def units(draw) -> UnitsSpec:
    kind = draw(st.sampled_from(UnitsKind))
    names = {UnitsKind.AUTO: st.just([]), UnitsKind.PATTERNS: st.lists(PATTERNS, min_size=1, max_size=3),
             UnitsKind.TYPE: st.lists(NAMES, min_size=1, max_size=3)}[kind]
    return UnitsSpec(kind, tuple(draw(names)))


@st.composite
def strategies(draw) -> Strategy:
    mesh = draw(meshes())
    patterns = draw(st.lists(PATTERNS, max_size=3, unique=True))
    bucket = st.builds(lambda n, unit: n * unit, st.integers(1, 4096),
                       st.sampled_from(sorted(BUCKET_UNITS.values()))).filter(lambda n: n <= MAX_BUCKET)
    top = draw(scopes(mesh))
    return Strategy(
        name=draw(NAMES), mesh=mesh, scopes=top,
        accumulate=draw(st.integers(1, 1_000_000)), prefetch=draw(st.integers(0, 1024)),
        collectives=draw(st.sampled_from([Collectives(n) for n in ("auto", *algorithms.names())])), units=draw(units()), buffers=draw(st.sampled_from(BufferSync)),
        bucket=draw(st.none() | bucket | st.integers(1, 10**MAX_DIGITS - 1)),
        overrides=tuple(partial_override(draw, pt, mesh, top) for pt in patterns),
        experts=draw(st.none() | experts(mesh, top)))


def partial_override(draw, pattern: str, mesh: Mesh, top: Scopes) -> Override:
    """An override block setting a random subset of the three states of valid scopes; when
    that subset stacked on `top` would break the dependency rule, the block sets all three."""
    sc = draw(scopes(mesh))
    kept = draw(st.sets(st.sampled_from(STATES), min_size=1))
    stacked = replace(top, **{k: getattr(sc, k) for k in kept})
    if any(stacked.missing(inner, outer) for inner, outer in DEPENDENCY):
        kept = set(STATES)
    return Override(pattern, **{k: getattr(sc, k) for k in kept})


@st.composite
def experts(draw, mesh: Mesh, top: Scopes) -> Experts:
    """An `experts` statement: ep 1, a divisor of the innermost level, or a whole level; a
    partial block (maybe none) of valid scopes that name a level ep takes whole only as
    `world`; when the block stacked on `top` breaks the dependency rule, it sets all three."""
    inner = mesh.levels[-1]
    eps = {"none": [(1, "")],
           "part": [(d, inner.name) for d in range(2, inner.size) if inner.size % d == 0],
           "whole": [(lv.size, lv.name) for lv in mesh.levels if lv.size > 1]}
    ep, level = draw(st.sampled_from(eps[draw(st.sampled_from([k for k, v in eps.items() if v]))]))
    whole = level if ep > 1 and mesh.size(level) == ep else ""

    def drop(levels):        # each state loses the same level: the dependency rule still holds
        return levels if tuple(levels) == mesh.names else tuple(n for n in levels if n != whole)
    sc = draw(scopes(mesh))
    sc = Scopes(replace(sc.params, levels=drop(sc.params.levels)), replace(sc.grads, levels=drop(sc.grads.levels)),
                replace(sc.optim, levels=drop(sc.optim.levels), granularity=Granularity.FLAT))   # no `by` yet
    sc = replace(sc, params=replace(sc.params, comm=sc.params.dtype) if not sc.params.levels else sc.params,
                 grads=replace(sc.grads, comm=sc.grads.dtype) if not sc.grads.levels else sc.grads)
    if not sc.params.levels and sc.params.secondary is not None:
        sc = replace(sc, params=replace(sc.params, secondary=None))
    kept = draw(st.sets(st.sampled_from(STATES)))
    stacked = replace(top, **{k: getattr(sc, k) for k in kept})
    if any(stacked.missing(i, o) for i, o in DEPENDENCY):
        kept = set(STATES)
    return Experts(draw(PATTERNS), ep, level, **{k: getattr(sc, k) for k in kept})


@ROUND_TRIP
@given(strategies())
def test_random_strategy_round_trips(s):
    round_trip(s)


# --- real text -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_shipped_example_round_trips(path, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    s = load_strategy(path, world_size=8)
    back = round_trip(s)
    assert back.mesh == s.mesh and back.name == path.stem


@pytest.mark.parametrize("stem, name", [(None, "unnamed"), ("my-plan", "my_plan"), ("mesh", "mesh_"),
                                        ("3d", "_3d"), ("broadcast", "broadcast_")])
def test_a_strategy_without_a_strategy_line_unparses(tmp_path, stem, name):
    """Its default name (`unnamed` for text, else the file's stem made a name) is never a
    keyword, so any loaded strategy writes back as text and reads back the same."""
    text = "mesh node(2) > gpu(2)\nparams shard over gpu\ngrads shard over gpu\noptim shard over world\n"
    if stem is not None:
        (tmp_path / f"{stem}.shard").write_text(text)
    s = load_strategy(text if stem is None else tmp_path / f"{stem}.shard")
    assert s.name == name
    assert round_trip(s).name == name


STACKED = """\
strategy stacked
mesh node(2) > gpu(4)
params shard over gpu
grads  shard over gpu dtype bf16
optim  shard over world
accumulate 4
prefetch 2
collectives hierarchical
units type Block, Embedding
bucket 25MB
override "blocks.0" {
    params shard over world
    grads  shard over world
}
override "blocks.*" {
    optim  shard over world
}
"""


def test_overrides_write_only_what_the_block_sets():
    """An override keeps the states it mentions (even one equal to the top level) and
    leaves out those it inherits; the text is already canonical, so it comes back as is."""
    s = load_strategy(STACKED)
    assert unparse(s) == STACKED
    assert [o.pattern for o in round_trip(s).overrides] == ["blocks.0", "blocks.*"]


def test_options_and_sizes_are_written_in_canonical_form():
    mesh = Mesh((Level("node", 2), Level("gpu", 4)))
    s = Strategy("zpp", mesh, Scopes(ParamsSpec(("gpu",), Secondary(("node", "gpu"), DType.INT4), DType.INT8),
                                     GradsSpec(("gpu",), DType.INT4, DType.BF16), OptimSpec(("node", "gpu"))),
                 bucket=2 * 2**20, units=UnitsSpec(UnitsKind.PATTERNS, ("h.*", "wte")))
    assert unparse(s).splitlines()[2:] == [
        "params shard over gpu secondary node, gpu int4 comm int8",
        "grads  shard over gpu comm int4 dtype bf16",
        "optim  shard over world",
        "accumulate 1", "prefetch 1", "collectives auto",
        'units "h.*", "wte"',
        "bucket 2MiB",
    ]
    round_trip(s)


def test_replicated_state_never_carries_comm():
    """`comm` needs a collective: a replicated state's comm dtype is not written (the DSL
    would reject it), its storage dtype is."""
    mesh = Mesh((Level("gpu", 4),))
    sc = Scopes(ParamsSpec((), comm=DType.BF16, dtype=DType.BF16), GradsSpec(("gpu",), DType.BF16, DType.BF16),
                OptimSpec(("gpu",)))
    text = unparse(Strategy("planned", mesh, sc))
    assert "params replicate dtype bf16\ngrads  shard over gpu dtype bf16\n" in text
    assert load_strategy(text).scopes.grads.comm is DType.BF16   # comm follows dtype


@pytest.mark.parametrize("change, culprit", [
    (dict(name="my-plan"), "strategy name 'my-plan'"),
    (dict(name="mesh"), "strategy name 'mesh'"),
    (dict(mesh=Mesh((Level("world", 2),))), "level 'world'"),
    (dict(units=UnitsSpec(UnitsKind.PATTERNS, ('a"b',))), "unit pattern 'a\"b'"),
    (dict(overrides=(Override("a\nb", optim=OptimSpec(())),)), "override pattern 'a\\nb'"),
    (dict(overrides=(Override("blocks.*"),)), "override 'blocks.*' sets no state"),
    (dict(bucket=10**12 + 1), "bucket size 1000000000001"),
])
def test_unwritable_names_are_one_sentence_naming_the_culprit(change, culprit):
    s = replace(Strategy("ok", Mesh((Level("gpu", 2),)), Scopes()), **change)
    with pytest.raises(ShardcError) as e:
        unparse(s)
    assert str(e.value).startswith(culprit) and "cannot be written in a .shard file" in str(e.value)
