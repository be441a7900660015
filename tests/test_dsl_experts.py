"""The `experts` statement (docs/language.md): each form resolves to its `Experts`, the
experts' mesh and scopes, every error located, the JSON view and the canonical text."""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from shardc.cli import cmd_check
from shardc.dsl import ShardcError, StrategyError, load_text, unparse
from shardc.dsl.ir import DType, Experts, GradsSpec, Level, Mesh, MeshDims, OptimSpec, ParamsSpec, Scopes, Strategy
from shardc.dsl.serialize import strategy_dict

TOP = "mesh node(2) > gpu(4)\nparams shard over world\ngrads  shard over world\noptim  shard over world\n"
PAT = '"layers.*.moe.experts"'


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")


def load(text, **kw):
    kw.setdefault("world_size", 8)
    return load_text(text, "t.shard", **kw)


def errors(text, **kw) -> list[tuple[str, str, str | None]]:
    """(line:col, message, help) of each error, in source order."""
    with pytest.raises(StrategyError) as e:
        load(text, **kw)
    return [(f"{d.span.line}:{d.span.col}", d.message, d.hint) for d in e.value.errors]


# ---- the forms ------------------------------------------------------------------------

@pytest.mark.parametrize("clause, ep, level", [
    ("", 1, ""), (" ep 1", 1, ""), (" ep 2", 2, "gpu"), (" ep 4", 4, "gpu"),
    (" ep gpu", 4, "gpu"), (" ep node", 2, "node"),
])
def test_ep_forms(clause, ep, level):
    s = load(TOP + f"experts {PAT}{clause}\n")
    assert s.experts == Experts("layers.*.moe.experts", ep, level, line=5)
    assert s.line_of("experts") == 5


def test_ep_of_a_level_of_size_one_is_no_expert_parallelism():
    s = load("mesh node(8) > gpu(1)\nexperts \"e\" ep gpu\n")
    assert (s.experts.ep, s.experts.level) == (1, "")
    assert s.expert_mesh == s.mesh


def test_one_level_mesh_borrows_from_its_only_level():
    s = load("mesh gpu(8)\noptim shard over gpu\nexperts \"e\" ep 2\n")
    assert (s.experts.ep, s.experts.level) == (2, "gpu")
    assert s.expert_mesh == Mesh((Level("gpu", 4),))


def test_no_block_takes_the_top_level_scopes_over_the_experts_mesh():
    s = load(TOP + f"experts {PAT} ep 2\n")
    assert s.experts.sets() == ()
    assert s.expert_mesh == Mesh((Level("node", 2), Level("gpu", 2)))
    assert s.expert_scopes == s.scopes
    assert s.expert_mesh.factor(s.expert_scopes.params.levels) == 4


def test_partial_block_over_the_top_level():
    s = load("mesh node(2) > gpu(4)\nparams shard over gpu\ngrads  shard over gpu\noptim  shard over world\n"
             "accumulate 4\n"
             f"experts {PAT} ep gpu {{\n    params replicate\n    grads  replicate dtype bf16\n"
             "    optim  shard over node\n}\n")
    e = s.experts
    assert e == Experts("layers.*.moe.experts", 4, "gpu", ParamsSpec((), line=7),
                        GradsSpec((), DType.BF16, DType.BF16, line=8), OptimSpec(("node",), line=9), line=6)
    assert s.expert_mesh == Mesh((Level("node", 2), Level("gpu", 1)))
    assert s.expert_scopes == Scopes(e.params, e.grads, e.optim)
    assert s.warnings == ()          # `node` without `gpu`: not partial, ep takes gpu whole


def test_one_statement_on_the_brace_line_and_unset_states_inherit():
    s = load(TOP + f"experts {PAT} ep 2 {{ params shard over gpu dtype bf16 }}\n")
    e = s.experts
    assert e.sets() == ("params",) and e.params == ParamsSpec(("gpu",), None, DType.BF16, DType.BF16, 5)
    assert s.expert_scopes == replace(s.scopes, params=e.params)


def test_world_in_the_block_is_every_level_even_the_one_ep_takes_whole():
    s = load(TOP + f"experts {PAT} ep gpu {{\n  optim shard over world\n}}\n")
    assert s.experts.optim == OptimSpec(("node", "gpu"), 6)
    assert s.expert_mesh.factor(s.experts.optim.levels) == 2


def test_secondary_may_name_the_level_ep_takes_whole():
    s = load(TOP + f"experts {PAT} ep gpu {{\n  params shard over node secondary gpu\n}}\n")
    assert s.experts.params.levels == ("node",) and s.experts.params.secondary.levels == ("gpu",)


def test_a_part_of_the_level_may_be_named():
    s = load(TOP + f"experts {PAT} ep 2 {{\n  params shard over gpu\n  grads shard over gpu\n}}\n")
    assert s.experts.params.levels == ("gpu",) and s.expert_mesh.factor(("gpu",)) == 2


def test_partial_scope_warning_still_applies_to_a_level_ep_splits():
    s = load(TOP + f"experts {PAT} ep 2 {{\n  params shard over node\n}}\n")
    assert len(s.warnings) == 1
    assert "`params` shards over `node` but not over `gpu` inside it" in s.warnings[0]
    assert " --> t.shard:6:10" in s.warnings[0]


def test_the_mesh_override_gives_the_sizes():
    s = load(TOP + f"experts {PAT} ep 3\n", mesh="node(2) > gpu(3)", world_size=6)
    assert (s.experts.ep, s.experts.level) == (3, "gpu")
    s = load_text(f"mesh node(*) > gpu(local)\nexperts {PAT} ep gpu\n", mesh=MeshDims(("node", "gpu"), (4, 2)))
    assert (s.experts.ep, s.experts.level) == (2, "gpu")


# ---- errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("ep", ["3", "8"])
def test_ep_must_divide_the_innermost_level(ep):
    assert errors(TOP + f"experts {PAT} ep {ep}\n") == [
        ("5:35", f"ep {ep} does not divide level `gpu` (size 4), the innermost level it borrows its ranks from",
         "use a divisor of 4, or `ep gpu` for the whole level")]


@pytest.mark.parametrize("text, size", [("mesh node(2) > gpu(2)\n", 2), ("mesh node(*) > gpu(4)\n", 4),
                                         ("mesh node(2) > gpu(local)\n", 4)])
def test_ep_is_checked_against_sizes_known_when_the_mesh_fails(text, size):
    got = errors(text + 'experts "e" ep 3\n', world_size=None if "*" in text else 12)
    assert len(got) == 2 and got[1][:2] == ("2:16", f"ep 3 does not divide level `gpu` (size {size}), the "
                                                    f"innermost level it borrows its ranks from")


def test_ep_against_an_assumed_local_size(monkeypatch):
    """`local` without LOCAL_WORLD_SIZE is assumed (with its warning), as the mesh check does."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setattr("shardc.dsl.mesh._cuda_devices", lambda: 0)
    with pytest.raises(StrategyError) as e:
        load('mesh node(*) > gpu(local)\nexperts "e" ep 2\n')
    assert [d.message for d in e.value.errors] == [
        "ep 2 does not divide level `gpu` (size 1), the innermost level it borrows its ranks from"]
    assert "`gpu(local)` assumed to be 1" in str(e.value)


@pytest.mark.parametrize("ep, message", [("0", "`ep` must be at least 1, got 0"),
                                         ("-2", "`ep` must be at least 1, got -2")])
def test_ep_range(ep, message):
    assert [e[:2] for e in errors(TOP + f'experts "e" ep {ep}\n')] == [("5:16", message)]


def test_ep_of_an_unknown_level():
    assert errors(TOP + 'experts "e" ep gpus\n') == [
        ("5:16", "level `gpus` is not declared in the mesh", "did you mean `gpu`?")]


def test_empty_pattern():
    assert errors(TOP + 'experts ""\n') == [
        ("5:9", "the experts pattern is empty",
         'write a glob over parameter and module names, e.g. "layers.*.moe.experts"')]


def test_empty_block():
    assert [e[:2] for e in errors(TOP + 'experts "e" ep 2 {}\n')] == [("5:1", 'experts "e" sets nothing')]
    assert [e[:2] for e in errors(TOP + 'experts "e" {\n}\n')] == [("5:1", 'experts "e" sets nothing')]


@pytest.mark.parametrize("state", ["params", "grads", "optim"])
def test_a_scope_cannot_name_the_level_ep_takes_whole(state):
    text = TOP + f'experts "e" ep gpu {{\n  {state} shard over node, gpu\n}}\n'
    col = len(f"  {state} shard over node, ") + 1
    assert errors(text) == [
        (f"6:{col}", f"the experts' `{state}` shard over `gpu`, whose ranks ep already splits the experts over "
                     "(ep gpu): a scope cannot include the ep ranks twice",
         f"drop `gpu` from the experts' `{state}`: their data-parallel ranks are the other levels'")]


def test_ep_written_as_the_level_size_takes_it_whole_too():
    got = errors(TOP + 'experts "e" ep 4 { optim shard over gpu, node }\n')
    assert [e[:2] for e in got] == [("5:37", "the experts' `optim` shard over `gpu`, whose ranks ep already splits "
                                             "the experts over (ep 4): a scope cannot include the ep ranks twice")]


def test_dependency_rule_in_the_block():
    got = errors("mesh node(2) > gpu(4)\nparams shard over gpu\ngrads shard over gpu\noptim shard over world\n"
                 'experts "e" ep 2 {\n  grads replicate\n}\n')
    assert [e[:2] for e in got] == [("6:9", 'in experts "e": dependency rule: `grads` (line 6) does not shard over '
                                            "`gpu`, which `params` (line 2) shards over")]


def test_dependency_hint_when_the_missing_level_is_taken_whole():
    got = errors(TOP + 'experts "e" ep gpu { optim shard over node }\n')
    assert got[0][:2] == ("5:28", 'in experts "e": dependency rule: `optim` (line 5) does not shard over `gpu`, '
                                  "which `grads` (line 3) shards over")
    assert got[0][2].endswith("ep takes `gpu` whole, so an experts scope holds it only as `shard over world`: "
                              "give the experts' `optim` that, or leave `gpu` out of their `grads`")


def test_undeclared_level_in_the_block():
    assert errors(TOP + 'experts "e" {\n  params shard over gpus\n}\n') == [
        ("6:21", "level `gpus` is not declared in the mesh", "did you mean `gpu`?")]


def test_duplicate_statement_and_duplicate_state():
    got = errors(TOP + 'experts "a"\nexperts "b" ep 2\n')
    assert [e[:2] for e in got] == [("6:1", "duplicate `experts` statement: given on lines 5 and 6")]
    got = errors(TOP + 'experts "a" {\n  optim shard over world\n  optim shard over world\n}\n')
    assert [e[:2] for e in got] == [("7:3", "duplicate `optim` statement in this experts block: given on lines 6 and 7")]


@pytest.mark.parametrize("text, where, message", [
    ('experts "e" {\n  prefetch 2\n}\n', "6:3", "`prefetch` cannot appear in an `experts` block"),
    ('experts "e" {\n  parms replicate\n}\n', "6:3", "unknown statement `parms` in an `experts` block"),
    ('experts "e" {\n  optim replicate\n', "5:13", "unclosed `experts` block: no `}` before the end of the file"),
    ('experts e\n', "5:9", "expected a quoted pattern after `experts`, found `e`"),
    ('experts "e" gpu\n', "5:13", "expected `ep`, `{` or the end of the line after the pattern, found `gpu`"),
    ('experts "e" ep\n', "5:15", "expected a number or a level name after `ep`, found end of line"),
    ('experts "e" ep world\n', "5:16", "`world` is a reserved keyword and cannot be used as a level name"),
])
def test_syntax_errors(text, where, message):
    assert (where, message) in [e[:2] for e in errors(TOP + text)]


@pytest.mark.parametrize("text, col, word", [("mesh experts(2) > gpu(4)\n", 6, "experts"),
                                             ("mesh node(2) > ep(4)\n", 16, "ep")])
def test_experts_and_ep_are_reserved(text, col, word):
    assert errors(text) == [(f"1:{col}", f"`{word}` is a reserved keyword and cannot be used as a level name",
                             f"rename it, e.g. `{word}_`; keywords are listed in the language reference")]


def test_a_level_named_like_a_keyword_cannot_be_unparsed():
    with pytest.raises(ShardcError, match="level 'ep' cannot be written"):
        unparse(Strategy("s", Mesh((Level("ep", 2),)), Scopes()))


# ---- JSON ---------------------------------------------------------------------------------

def test_json_of_the_experts():
    s = load(TOP + f"experts {PAT} ep 2 {{\n  params shard over gpu comm bf16\n  grads shard over world\n}}\n")
    assert strategy_dict(s)["experts"] == {
        "pattern": "layers.*.moe.experts", "ep": 2, "level": "gpu", "line": 5,
        "params": {"levels": ["gpu"], "factor": 2, "secondary": None, "comm": "bf16", "dtype": "fp32"},
        "grads": {"levels": ["node", "gpu"], "factor": 4, "comm": "fp32", "dtype": "fp32"},
        "optim": None}
    assert strategy_dict(load(TOP))["experts"] is None


def test_check_json_through_the_cli(tmp_path, capsys):
    f = tmp_path / "moe.shard"
    f.write_text(TOP + f"experts {PAT} ep gpu\n")
    p = argparse.ArgumentParser(prog="shardc check")
    cmd_check.add_arguments(p)
    assert cmd_check.run(p.parse_args([str(f), "--world", "8", "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["experts"] == {"pattern": "layers.*.moe.experts", "ep": 4, "level": "gpu", "line": 5,
                               "params": None, "grads": None, "optim": None}


# ---- canonical text -------------------------------------------------------------------------

@pytest.mark.parametrize("written, canonical", [
    (f"experts {PAT}", f"experts {PAT}"),
    (f"experts {PAT} ep 1", f"experts {PAT}"),
    (f"experts {PAT} ep 2", f"experts {PAT} ep 2"),
    (f"experts {PAT} ep 4", f"experts {PAT} ep gpu"),
    (f"experts {PAT} ep node {{ optim shard over world }}",
     f"experts {PAT} ep node {{\n    optim  shard over world\n}}"),
    (f"experts {PAT} ep gpu {{\n  grads shard over world\n  params shard over node\n}}",
     f"experts {PAT} ep gpu {{\n    params shard over node\n    grads  shard over world\n}}"),
])
def test_unparse_writes_the_canonical_form(written, canonical):
    s = load(TOP + written + "\n")
    text = unparse(s)
    assert text.endswith("collectives auto\n" + canonical + "\n")
    back = load(text)
    assert back.experts.sets() == s.experts.sets()
    assert (back.experts.pattern, back.experts.ep, back.experts.level) == (s.experts.pattern, s.experts.ep,
                                                                           s.experts.level)


def test_one_level_mesh_writes_world_for_the_level_ep_takes_whole():
    s = load("mesh gpu(8)\noptim shard over gpu\nexperts \"e\" ep gpu {\n  optim shard over world\n}\n")
    assert unparse(s).endswith('experts "e" ep gpu {\n    optim  shard over world\n}\n')


M3 = Mesh((Level("node", 2), Level("gpu", 4), Level("gcd", 2)))


@pytest.mark.parametrize("experts, culprit", [
    (Experts("e", 1, "gcd"), "experts 'e' with ep 1 over level 'gcd'"),
    (Experts("e", 2, "gpu"), "experts 'e' with ep 2 over level 'gpu'"),        # part of a non-innermost level
    (Experts("e", 3, "gpu"), "experts 'e' with ep 3 over level 'gpu'"),
    (Experts("e", 2, "tpu"), "experts 'e' with ep 2 over level 'tpu'"),
    (Experts("e", 4, "gpu", optim=OptimSpec(("node", "gpu"))), "the experts' scope over node, gpu"),
    (Experts('a"b'), "experts pattern 'a\"b'"),
])
def test_unwritable_experts_are_one_sentence(experts, culprit):
    with pytest.raises(ShardcError) as e:
        unparse(Strategy("s", M3, Scopes(), experts=experts))
    assert str(e.value).startswith(culprit) and "cannot be written in a .shard file" in str(e.value)


def test_an_experts_strategy_keeps_each_ranks_buffers_unless_told():
    # [Note: buffers of a mixture-of-experts strategy]: load-balancing counters add up per rank
    import shardc
    from shardc.dsl.ir import BufferSync
    from shardc.dsl.unparse import unparse
    base = "mesh node(2) > gpu(2)\noptim shard over world\n"
    assert shardc.load_strategy(base).buffers is BufferSync.BROADCAST
    moe = shardc.load_strategy(base + 'experts "*.experts" ep 2\n')
    told = shardc.load_strategy(base + 'experts "*.experts" ep 2\nbuffers broadcast\n')
    assert (moe.buffers, told.buffers) == (BufferSync.LOCAL, BufferSync.BROADCAST)
    for s in (moe, told):
        assert shardc.load_strategy(unparse(s)).buffers is s.buffers
