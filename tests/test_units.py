"""shardc.units (units/): which parameters each unit gathers, under every `units` form, and
the membership rule every unit table obeys."""
import dataclasses

import pytest
import torch
from torch import nn

from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import (GradsSpec, Level, Mesh, OptimSpec, Override, ParamsSpec, Scopes, Strategy,
                           UnitsKind, UnitsSpec)
from shardc.units import ROOT, canonical_names, find_units, reorder, unit_members
from examples.gpt import GPT, TINY, GPTConfig

MESH = Mesh((Level("node", 2), Level("gpu", 2)))
ZERO3 = Scopes(ParamsSpec(("node", "gpu"), line=3), GradsSpec(("node", "gpu"), line=4), OptimSpec(("node", "gpu"), line=5))


def strat(units=UnitsSpec(), bucket=0, overrides=()):
    """bucket 0 by default: the finder merges nothing (the cost model's size is tested in test_bucket_auto)."""
    return Strategy("t", MESH, ZERO3, units=units, bucket=bucket, overrides=overrides, file="t.shard")


def all_params(units):
    return [p for u in units for p in u.params]


def test_auto_gpt_blocks_and_tied_root():
    m = GPT(TINY)
    units = find_units(m, strat())
    assert [u.name for u in units] == [ROOT, "transformer.h.0", "transformer.h.1"]
    assert units[0].modules == () and units[1].modules == ("transformer.h.0",)
    # tied lm_head.weight is wte.weight: one canonical name, in the root unit, alias nowhere
    assert "transformer.wte.weight" in units[0].params
    assert "lm_head.weight" not in all_params(units)
    # every parameter exactly once: 2 embeddings + ln_f(2) + 11 per block (c_attn has no bias)
    assert len(all_params(units)) == len(set(all_params(units))) == 4 + 11 * 2
    assert all(p.startswith("transformer.h.1.") for p in units[2].params)
    assert all(u.scopes == ZERO3 for u in units)


def test_patterns_outermost_wins_and_registration_order():
    m = GPT(TINY)
    spec = UnitsSpec(UnitsKind.PATTERNS, ("transformer.h.*", "lm_head"), line=7)
    units = find_units(m, strat(spec))
    # "transformer.h.*" also matches transformer.h.0.attn etc.; only the blocks remain
    assert [u.name for u in units] == [ROOT, "transformer.h.0", "transformer.h.1", "lm_head"]
    # lm_head's weight is tied to wte (root): its only use is not inside lm_head -> root
    assert units[3].params == ()


def test_type_units():
    m = GPT(TINY)
    units = find_units(m, strat(UnitsSpec(UnitsKind.TYPE, ("MLP",), line=7)))
    assert [u.name for u in units] == [ROOT, "transformer.h.0.mlp", "transformer.h.1.mlp"]
    assert units[1].params == ("transformer.h.0.mlp.c_fc.weight", "transformer.h.0.mlp.c_fc.bias",
                               "transformer.h.0.mlp.c_proj.weight", "transformer.h.0.mlp.c_proj.bias")


def test_no_match_is_located():
    with pytest.raises(ShardcError, match=r'^t\.shard:7: units pattern "x\.\*" matches no module$'):
        find_units(GPT(TINY), strat(UnitsSpec(UnitsKind.PATTERNS, ("x.*",), line=7)))
    with pytest.raises(ShardcError, match=r"^t\.shard:8: units type Nope matches no module$"):
        find_units(GPT(TINY), strat(UnitsSpec(UnitsKind.TYPE, ("Nope",), line=8)))


class TiedInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(3, 3)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3)) for _ in range(2))
        self.blocks[0][1].weight = self.blocks[0][0].weight     # tied inside one block
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


def test_tied_inside_one_unit_stays_there_and_frozen_included():
    units = find_units(TiedInside(), strat())
    names = {u.name: u for u in units}
    assert names["blocks.0"].params == ("blocks.0.0.weight", "blocks.0.0.bias", "blocks.0.1.bias")
    assert names[ROOT].params == ("emb.weight", "emb.bias", "frozen.weight", "frozen.bias")


def test_override_and_dependency_recheck():
    units = find_units(GPT(TINY), strat(overrides=(Override("transformer.h.1", ParamsSpec((), line=10), line=9),)))
    assert units[2].scopes.params.levels == () and units[2].scopes.grads == ZERO3.grads
    assert units[1].scopes == ZERO3
    bad = Override("transformer.h.*", ParamsSpec(("node", "gpu"), line=10), GradsSpec(("gpu",), line=11), line=9)
    with pytest.raises(ShardcError, match=r"^t\.shard:9: .*dependency rule"):
        find_units(GPT(TINY), strat(overrides=(bad,)))
    with pytest.raises(ShardcError, match=r'^t\.shard:9: override pattern "zzz" matches no unit'):
        find_units(GPT(TINY), strat(overrides=(Override("zzz", ParamsSpec((), line=10), line=9),)))


def test_bucket_merges_consecutive_small_units():
    m = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=5, n_head=1, n_embd=8))
    block_bytes = 4 * sum(p.numel() for p in m.transformer.h[0].parameters())
    units = find_units(m, strat(bucket=2 * block_bytes))          # two blocks fit in one bucket
    assert [len(u.modules) for u in units] == [0, 2, 2, 1]
    assert units[1].name == "transformer.h.0..1"
    assert units[1].params == tuple(n for n, _ in m.named_parameters()
                                    if n.startswith(("transformer.h.0.", "transformer.h.1.")))
    assert len(all_params(units)) == len(set(all_params(units))) == 4 + 11 * 5
    assert len(find_units(m, strat(bucket=block_bytes - 1))) == 6   # nothing under the size


def test_meta_model_and_reorder():
    with torch.device("meta"):
        m = GPT(TINY)
    units = find_units(m, strat())
    again = reorder(units, ["transformer.h.1", "transformer.h.0"])
    assert [u.name for u in again] == [ROOT, "transformer.h.1", "transformer.h.0"]


def test_the_bucket_size_must_be_decided_first():
    with pytest.raises(ValueError, match="resolve_bucket"):
        find_units(GPT(TINY), strat(bucket=None))


def test_membership_rule():
    # [Note: unit membership], the one rule the compiler's check pass and shard_module apply
    m = GPT(TINY)
    units = find_units(m, strat())
    canon = canonical_names(m)
    assert canon["lm_head.weight"] == "transformer.wte.weight"
    assert unit_members(units, canon) == [u.params for u in units]
    with_alias = [dataclasses.replace(units[0], params=units[0].params + ("lm_head.weight",)), *units[1:]]
    assert unit_members(with_alias, canon)[0] == units[0].params          # the alias is its canonical name

    def breach(table):
        with pytest.raises(ShardcError) as e:
            unit_members(table, canon)
        return str(e.value)

    assert breach(units[1:]) == "the unit list must start with the root unit '<root>'"
    assert breach([dataclasses.replace(units[0], params=("nope",)), *units[1:]]) == \
        "unit '<root>' lists 'nope', which is not a parameter of the model"
    tied = [*units[:2], dataclasses.replace(units[2], params=units[2].params + ("lm_head.weight",))]
    assert breach(tied) == ("parameter 'transformer.wte.weight' is in units '<root>' and 'transformer.h.1'; "
                            "tied parameters must share one unit")
    twice = [*units[:2], dataclasses.replace(units[2], params=units[2].params + (units[1].params[0],))]
    assert breach(twice) == ("parameter 'transformer.h.0.ln_1.weight' is listed in more than one unit "
                             "('transformer.h.0' and 'transformer.h.1')")
    assert breach(units[:2]) == "parameter 'transformer.h.1.ln_1.weight' is in no unit (every parameter needs one)"
    with pytest.raises(KeyError, match="in no unit"):                     # the caller's error class
        unit_members(units[:2], canon, KeyError)
