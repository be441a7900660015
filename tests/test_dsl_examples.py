"""The twelve named strategies resolve to the levels of the layouts they stand for.

Mesh `node(*) > gpu(local)` at world 8 with LOCAL_WORLD_SIZE=4 is node(2) > gpu(4), so
`world` = (node, gpu) with factor 2*4 = 8 and `gpu` has factor 4. zero_topo runs on the
override `node(2) > gpu(2) > gcd(2)`: gcd = 2, (gpu, gcd) = 2*2 = 4, world = 2*2*2 = 8.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import shardc
from shardc.cli import cmd_check
from shardc.dsl.ir import STATES, DType

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "strategies"
W, G = ("node", "gpu"), ("gpu",)
TOPO_MESH = "node(2) > gpu(2) > gcd(2)"

# name: (params levels, grads levels, optim levels) — the layout each named strategy stands for.
TABLE = {
    "ddp": ((), (), ()),
    "zero1": ((), (), W),
    "zero2": ((), W, W),
    "zero3": (W, W, W),
    "mics": (G, G, G),
    "hsdp_zero2": ((), G, G),
    "zeropp": (W, W, W),
    "paro_igg": (G, W, W),
    "paro_iig": (G, G, W),
    "paro_nig": ((), G, W),
    "lins_7b": ((), (), G),
    "zero_topo": (("gcd",), ("gpu", "gcd"), ("node", "gpu", "gcd")),
}
FACTOR = {(): 1, W: 2 * 4, G: 4, ("gcd",): 2, ("gpu", "gcd"): 2 * 2, ("node", "gpu", "gcd"): 2 * 2 * 2}


@pytest.fixture(autouse=True)
def _local4(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")


def _mesh_for(name):
    return TOPO_MESH if name == "zero_topo" else None


def test_every_table_entry_has_a_file():
    assert sorted(p.stem for p in EXAMPLES.glob("*.shard")) == sorted(TABLE)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_example_resolves_to_table(name):
    s = shardc.load_strategy(EXAMPLES / f"{name}.shard", world_size=8, mesh=_mesh_for(name))
    assert (s.params.levels, s.grads.levels, s.optim.levels) == TABLE[name]
    assert s.name == name and s.warnings == ()
    assert s.mesh.world == 8
    for state, levels in zip(STATES, TABLE[name]):
        assert s.factor(getattr(s, state).levels) == FACTOR[levels]
        assert getattr(s, state).line == s.line_of(state) > 0


@pytest.mark.parametrize("name", sorted(TABLE))
def test_example_header_cites_a_source(name):
    lines = (EXAMPLES / f"{name}.shard").read_text().splitlines()
    assert lines[0].startswith("# ") and lines[1].startswith("# ")
    assert "§" in lines[0] + lines[1]


def _check_json(argv, capsys):
    p = argparse.ArgumentParser(prog="shardc check")
    cmd_check.add_arguments(p)
    rc = cmd_check.run(p.parse_args(argv))
    out = capsys.readouterr()
    return rc, out


@pytest.mark.parametrize("name", sorted(TABLE))
def test_example_passes_check_json(name, capsys):
    argv = [str(EXAMPLES / f"{name}.shard"), "--world", "8", "--json"]
    if name == "zero_topo":
        argv += ["--mesh", TOPO_MESH]
    rc, out = _check_json(argv, capsys)
    assert rc == 0, out.err
    data = json.loads(out.out)
    assert list(data) == ["name", "mesh", "params", "grads", "optim", "accumulate", "prefetch",
                          "collectives", "buffers", "units", "bucket", "overrides", "experts", "warnings"]
    assert data["experts"] is None
    for state, levels in zip(STATES, TABLE[name]):
        assert data[state]["levels"] == list(levels)
        assert data[state]["factor"] == FACTOR[levels]
    assert data["warnings"] == []


def test_zeropp_options():
    s = shardc.load_strategy(EXAMPLES / "zeropp.shard", world_size=8)
    assert s.params.secondary.levels == G and s.params.secondary.quant is None
    assert s.params.comm is DType.INT8 and s.grads.comm is DType.INT4


def test_zero_topo_options_and_own_mesh():
    s = shardc.load_strategy(EXAMPLES / "zero_topo.shard", world_size=8, mesh=TOPO_MESH)
    assert s.params.secondary.levels == ("gpu", "gcd") and s.params.secondary.quant is DType.INT8
    assert s.params.comm is DType.INT8       # the forward all-gather over the 2 GCDs is quantized (§V-D)
    assert s.grads.comm is DType.INT4 and s.accumulate == 4
    # Without the override the file's own mesh node(*) > gpu(4) > gcd(2) needs world 8k.
    own = shardc.load_strategy(EXAMPLES / "zero_topo.shard", world_size=16)
    assert [(lv.name, lv.size) for lv in own.mesh.levels] == [("node", 2), ("gpu", 4), ("gcd", 2)]


@pytest.mark.parametrize("name", ["paro_iig", "paro_nig"])
def test_paro_partial_sync_examples_accumulate(name):
    assert shardc.load_strategy(EXAMPLES / f"{name}.shard", world_size=8).accumulate == 4
