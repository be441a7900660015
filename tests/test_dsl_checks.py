"""Static checks of docs/language.md beyond the corpus: warnings (exit 0), overrides and
inheritance, option values, mesh overrides, `local` and `*` resolution."""
from __future__ import annotations

import pytest

import shardc
from shardc.dsl import StrategyError, load_text
from shardc.dsl.diagnostics import Severity
from shardc.dsl.ir import Collectives, DType, Level, Mesh, UnitsKind

MESH = "mesh node(2) > gpu(4)\n"


def load(text, **kw):
    kw.setdefault("world_size", 8)
    return load_text(text, "t.shard", **kw)


def errors_of(text, **kw):
    with pytest.raises(StrategyError) as e:
        load(text, **kw)
    assert all(d.severity is Severity.ERROR for d in e.value.errors)
    return e.value


# ---- warnings -------------------------------------------------------------------------

def test_partial_scope_warns_lins_eq7():
    s = load(MESH + "params replicate\ngrads replicate\noptim shard over node\n")
    assert s.warnings == ("""warning: `optim` shards over `node` but not over `gpu` inside it
 --> t.shard:4:7
  |
4 | optim shard over node
  |       ^^^^^^^^^^^^^^^
  = help: its collectives then cross the `node` links at full volume (Lins eq. 7); add gpu or shard over inner levels only""",)


def test_partial_scope_three_levels_and_secondary():
    s = load("mesh node(2) > gpu(2) > gcd(2)\nparams shard over world secondary gpu\n"
             "grads shard over world\noptim shard over world\naccumulate 2\n")
    assert len(s.warnings) == 1 and "`secondary` shards over `gpu` but not over `gcd`" in s.warnings[0]
    assert not load("mesh node(2) > gpu(2) > gcd(2)\noptim shard over gpu, gcd\n").warnings


def test_ho_ring_without_multilevel_scope_warns():
    s = load(MESH + "params shard over gpu\ngrads shard over gpu\noptim shard over gpu\ncollectives ho-ring\n")
    assert len(s.warnings) == 1 and "`collectives ho-ring` has nothing to pipeline" in s.warnings[0]
    assert " --> t.shard:5:13" in s.warnings[0]
    s = load(MESH + "params shard over gpu\ngrads shard over world\noptim shard over world\n"
             "collectives ho-ring\n")
    assert s.warnings == () and s.collectives is Collectives.HO_RING


@pytest.mark.parametrize("given,line", [("accumulate 1\n", 5), ("", 3)])
def test_accumulate_one_with_partial_sync_warns(given, line):
    s = load(MESH + "params shard over gpu\ngrads shard over gpu\noptim shard over world\n" + given)
    assert len(s.warnings) == 1 and f" --> t.shard:{line}:" in s.warnings[0]
    assert "strict subset of `optim`'s levels" in s.warnings[0]
    assert not load(MESH + "params shard over gpu\ngrads shard over gpu\noptim shard over world\n"
                    "accumulate 4\n").warnings
    # zero1 (grads replicate) and zero2 (grads = optim) do not need accumulation.
    assert not load(MESH + "optim shard over world\n").warnings
    assert not load(MESH + "grads shard over world\noptim shard over world\n").warnings


def test_local_uses_env_else_warns(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    s = load("mesh node(*) > gpu(local)\n")
    assert s.mesh == Mesh((Level("node", 4), Level("gpu", 2))) and not s.warnings
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr("shardc.dsl.mesh._cuda_devices", lambda: 0)
    s = load("mesh node(*) > gpu(local)\n")
    assert s.mesh.size("gpu") == 1 and "assumed to be 1: LOCAL_WORLD_SIZE is not set" in s.warnings[0]
    monkeypatch.setattr("shardc.dsl.mesh._cuda_devices", lambda: 4)
    s = load("mesh node(*) > gpu(local)\n")
    assert s.mesh.size("gpu") == 4 and "torch.cuda.device_count() = 4" in s.warnings[0]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert "not a positive integer" in str(errors_of("mesh node(*) > gpu(local)\n"))


# ---- world size and mesh override -----------------------------------------------------

def test_star_needs_world(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    e = errors_of("mesh node(*) > gpu(4)\n", world_size=None)
    assert "the world size is unknown" in str(e) and "pass --world N" in str(e)
    monkeypatch.setenv("WORLD_SIZE", "12")
    assert load("mesh node(*) > gpu(4)\n", world_size=None).mesh.size("node") == 3


def test_explicit_mesh_without_world_is_fine():
    assert load("mesh node(2) > gpu(4)\n", world_size=None).mesh.world == 8


def test_mesh_override_string_and_object():
    text = MESH + "params shard over gpu\ngrads shard over gpu\noptim shard over world\naccumulate 2\n"
    s = load(text, mesh="a(2) > gpu(2) > node(2)")
    assert s.mesh.names == ("a", "gpu", "node") and s.optim.levels == ("a", "gpu", "node")
    assert s.line_of("mesh") == 1
    m = Mesh((Level("node", 4), Level("gpu", 2)))
    assert load(text, mesh=m).mesh == m
    assert "declares a level twice" in str(errors_of(text, mesh=Mesh((Level("gpu", 4), Level("gpu", 2)))))
    e = errors_of(text, mesh="node(2) > gpu(2)")
    assert "2 × 2 = 4 ranks but the world size is 8" in str(e) and "--> <mesh>:1:1" in str(e)
    assert "--> <mesh>:1:" in str(errors_of(text, mesh="node(2) >> gpu(4)"))


def test_mesh_override_replaces_missing_mesh_line():
    assert load("optim shard over world\n", mesh="node(2) > gpu(4)").mesh.world == 8


def test_bad_world_size_argument():
    with pytest.raises(shardc.ShardcError, match="positive integer"):
        load(MESH, world_size=0)


# ---- IR filling -----------------------------------------------------------------------

FULL = """strategy demo
mesh node(2) > gpu(4)
params shard over gpu, node secondary gpu int4 comm bf16 dtype bf16
grads  shard over world comm int8 dtype bf16
optim  shard over world
accumulate 3
prefetch 0
collectives hierarchical
units "transformer.h.*", "lm_head"
bucket 2MiB
override "transformer.h.0" {
  params replicate
  grads replicate
}
override "lm_*" { optim shard over world }
"""


def test_full_strategy_fills_ir():
    s = load(FULL)
    assert s.name == "demo" and s.file == "t.shard"
    assert s.params.levels == ("node", "gpu")          # mesh order, whatever the written order
    assert s.params.secondary.levels == ("gpu",) and s.params.secondary.quant is DType.INT4
    assert (s.params.comm, s.params.dtype, s.grads.comm, s.grads.dtype) == (DType.BF16, DType.BF16, DType.INT8, DType.BF16)
    assert (s.accumulate, s.prefetch, s.collectives) == (3, 0, Collectives.HIERARCHICAL)
    assert s.units.kind is UnitsKind.PATTERNS and s.units.names == ("transformer.h.*", "lm_head")
    assert s.units.line == 9 and s.bucket == 2 * 2**20
    assert s.lines == (("strategy", 1), ("mesh", 2), ("params", 3), ("grads", 4), ("optim", 5),
                       ("accumulate", 6), ("prefetch", 7), ("collectives", 8), ("units", 9), ("bucket", 10))
    (o1, o2) = s.overrides
    assert (o1.pattern, o1.line, o2.pattern, o2.line) == ("transformer.h.0", 11, "lm_*", 15)
    # A block stays partial: states it does not mention are None (not set by it).
    assert o1.params.levels == () and o1.grads.levels == () and o1.params.line == 12
    assert o1.optim is None and o1.sets() == ("params", "grads")
    assert o2.params is None and o2.grads is None and o2.optim.line == 15 and o2.sets() == ("optim",)


def test_repr_reads_back():
    from shardc.dsl import ir
    s = load(FULL)
    ns = {k: getattr(ir, k) for k in dir(ir)}
    assert eval(repr(s), ns) == s


@pytest.mark.parametrize("text,size", [("25MB", 25 * 10**6), ("1GB", 10**9), ("3KB", 3000), ("7B", 7),
                                       ("5KiB", 5 * 1024), ("1GiB", 2**30), ("1000", 1000)])
def test_bucket_units(text, size):
    assert load(MESH + f"bucket {text}\n").bucket == size


def test_units_forms():
    assert load(MESH + "units auto\n").units.kind is UnitsKind.AUTO
    u = load(MESH + "units type LlamaDecoderLayer, Block\n").units
    assert u.kind is UnitsKind.TYPE and u.names == ("LlamaDecoderLayer", "Block")


def test_name_defaults(tmp_path):
    assert load(MESH).name == "unnamed"        # not `strategy`: a keyword would not unparse
    p = tmp_path / "my_plan.shard"
    p.write_text(MESH)
    assert shardc.load_strategy(p, world_size=8).name == "my_plan"
    assert shardc.load_strategy(str(p), world_size=8).file == str(p)


def test_override_dependency_checked_after_inheritance():
    e = errors_of(MESH + "params shard over gpu\ngrads shard over gpu\noptim shard over world\n"
                  "accumulate 2\noverride \"x\" {\n  optim replicate\n}\n")
    assert 'in override "x": dependency rule: `optim` (line 7)' in str(e) and "`grads` (line 3)" in str(e)


def test_several_errors_in_one_run():
    e = errors_of(MESH + "params shard over gpux\ngrads shard over world comm int2\naccumulate -1\n")
    assert len(e.errors) == 3


def test_missing_file_and_bad_types(tmp_path):
    with pytest.raises(shardc.ShardcError, match="no such strategy file"):
        shardc.load_strategy(tmp_path / "nope.shard")
    with pytest.raises(shardc.ShardcError, match="expected a path or the text"):
        shardc.load_strategy(42)
    (tmp_path / "bin.shard").write_bytes(b"mesh gpu(4)\n\xff\xfe\n")
    with pytest.raises(StrategyError, match="not UTF-8"):
        shardc.load_strategy(tmp_path / "bin.shard")


@pytest.mark.parametrize("word", ["zero3", "paro_iig", " zero3 ", "nope"])
def test_a_strategy_named_not_given_as_a_file_is_one_sentence(word):
    # `shardc.compile(m, "zero3")`: one word, no newline, no such file. shardc resolves no
    # names (the shipped strategies are files, not package data): one sentence saying so,
    # naming the file of a shipped name, never "unknown statement `zero3`".
    with pytest.raises(shardc.ShardcError) as e:
        shardc.load_strategy(word)
    msg = str(e.value)
    assert not isinstance(e.value, StrategyError) and "\n" not in msg
    assert msg.startswith(f"no strategy file `{word.strip()}` (and it is not .shard text): ")
    if word.strip() == "nope":
        assert "zero3, zero_topo, zeropp); pass a path" in msg
    else:
        assert f"examples/strategies/{word.strip()}.shard; pass that path" in msg


@pytest.mark.parametrize("text, word, what", [
    ("mesh broadcast(2) > gpu(2)\n", "broadcast", "a level name"),
    ("mesh node(2) > buffers(2)\n", "buffers", "a level name"),
    (MESH + "params shard over node, world\n", "world", "a level name"),
    ("strategy mesh\n" + MESH, "mesh", "a strategy name"),
    (MESH + "units type Block, auto\n", "auto", "a unit type name"),
])
def test_a_keyword_as_a_name_is_reserved(text, word, what):
    (d,) = errors_of(text).errors
    assert d.message == f"`{word}` is a reserved keyword and cannot be used as {what}"
    line = text.split("\n")[d.span.line - 1]
    assert line[d.span.col - 1:].startswith(word) and d.span.end_col - d.span.col == len(word)


def test_parse_mesh_text():
    from shardc.dsl import parse_mesh_text
    assert parse_mesh_text("node(2) > gpu(2) > gcd(2)") == Mesh((Level("node", 2), Level("gpu", 2), Level("gcd", 2)))
    assert parse_mesh_text("node(*) > gpu(4)", world_size=16).size("node") == 4
    with pytest.raises(StrategyError, match="declared twice"):
        parse_mesh_text("gpu(2) > gpu(2)")


def test_no_lark_object_leaves_the_dsl():
    """AST and Strategy hold only plain Python values and shardc dataclasses."""
    import dataclasses
    import lark
    from shardc.dsl.parser import parse_program

    program, _ = parse_program(FULL, "t.shard")

    def walk(x):
        assert not isinstance(x, (lark.Tree, lark.Token)), x
        assert type(x).__module__.split(".")[0] in ("builtins", "shardc"), type(x)
        if dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, (tuple, list)):
            for y in x:
                walk(y)
    walk(program)
    walk(load(FULL))


def test_dependency_reported_with_other_errors():
    e = errors_of(MESH + "params shard over world\ngrads shard over gpu\noptim shard over world\n"
                  "accumulate 0\nbucket 3XB\n")
    msgs = [d.message for d in e.errors]
    assert len(msgs) == 3 and msgs[0].startswith("dependency rule: `grads` (line 3)")
    # ... but not when a broken line may have been the missing scope statement
    e = errors_of(MESH + "params shard over world\ngrads shard over world\noptm shard over world\n")
    assert [d.message for d in e.errors] == ["unknown statement `optm`"]


def _deep_mesh(levels: int) -> str:
    return "strategy s\nmesh " + " > ".join(f"l{i}(1)" for i in range(levels)) + "\nparams shard over l0\ngrads shard over l0\noptim shard over l0\n"


@pytest.mark.parametrize("via", ["file", "override"])
def test_hostile_mesh_is_rejected_fast_and_briefly(via):
    """A 5,000-level mesh line (~54 KB): one located error, short, in well under 0.5 s."""
    import time
    text = _deep_mesh(5000)
    assert len(text) > 50_000
    best = float("inf")
    for _ in range(3):                      # the best of three: a busy machine only slows some
        t0 = time.perf_counter()
        with pytest.raises(StrategyError) as e:
            if via == "file":
                load_text(text)
            else:
                load_text(_deep_mesh(2), mesh=text.split("\n")[1][len("mesh "):])
        best = min(best, time.perf_counter() - t0)
    assert best < 0.5, best
    msg = str(e.value)
    assert msg.startswith("error: the mesh has 5000 levels; at most 16 are supported")
    assert len(msg) < 600 and "1 × " not in msg and msg.count("error") == 1


def test_sixteen_levels_are_fine_seventeen_located():
    assert len(load_text(_deep_mesh(16), world_size=1).mesh.levels) == 16
    with pytest.raises(StrategyError) as e:
        load_text(_deep_mesh(17))
    col = _deep_mesh(17).split("\n")[1].index("l16(1)") + 1
    assert f"<string>:2:{col}" in str(e.value)
