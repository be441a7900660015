"""compiler/codegen: the emitted module (goldens, compile(), determinism, comments, structure check)."""
import os
import re

import pytest
import torch

from shardc.api import load_emitted
from shardc.compiler.api import compile_source
from shardc.dsl.errors import ShardcError
from examples.gpt import GPT, GPTConfig, tiny
from tests import regen_emitted

GOLDEN = regen_emitted.GOLDEN_DIR


@pytest.mark.parametrize("name", sorted(regen_emitted.CASES))
def test_emitted_matches_golden(name):
    path = os.path.join(GOLDEN, f"{name}.py")
    assert os.path.exists(path), f"missing golden {path}: run `python tests/regen_emitted.py` and review it"
    with open(path, encoding="utf-8") as f:
        golden = f.read()
    got = regen_emitted.emitted(name)
    assert got == golden, f"emitted code for {name} changed; if intended, run tests/regen_emitted.py"


@pytest.mark.parametrize("name", sorted(regen_emitted.CASES))
def test_emitted_compiles_and_is_deterministic(name):
    a, b = regen_emitted.emitted(name), regen_emitted.emitted(name)
    assert a == b
    compile(a, name, "exec")
    ns = load_emitted(a, name)
    assert callable(ns["shard_model"]) and callable(ns["forward"])
    assert [u.name for u in ns["UNITS"]] == ["<root>", "transformer.h.0", "transformer.h.1"]


def test_every_collective_line_names_its_strategy_statement():
    src = regen_emitted.emitted("gpt_tiny_paro_iig")
    with open(os.path.join(os.path.dirname(GOLDEN), "..", "..", "examples", "strategies", "paro_iig.shard")) as f:
        lines = f.read().splitlines()
    body = src[src.index("def forward"):src.index("def check_structure")]
    calls = [ln for ln in body.splitlines() if re.search(r"rt\.(issue_gather|wait_gather|run_unit|begin_forward)", ln)]
    assert len(calls) == 1 + 2 + 2 + 2           # begin, 2 issues, 2 waits, 2 unit runs
    for ln in calls:
        refs = re.findall(r"paro_iig\.shard:(\d+) ([^;(]+)", ln)
        assert refs, ln
        for num, stmt in refs:                    # the comment quotes the statement on that line
            assert lines[int(num) - 1].split("#")[0].strip().split() == stmt.split(), (num, stmt)
    assert "rt.issue_gather(2)" in body.split("rt.wait_gather(1)")[0]        # prefetch 1


def test_wrong_model_names_the_first_differing_parameter():
    ns = load_emitted(regen_emitted.emitted("gpt_tiny_zero3"), "zero3")
    wider = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=48))
    with pytest.raises(ShardcError, match=r"parameter transformer\.wte\.weight \(64, 48\) differs from the "
                                          r"compiled model's transformer\.wte\.weight \(64, 32\)"):
        ns["shard_model"](wider)
    deeper = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32))
    with pytest.raises(ShardcError, match=r"parameter transformer\.h\.2\.ln_1\.weight \(32,\) differs"):
        ns["shard_model"](deeper)
    ns["check_structure"](tiny())                 # the compiled structure passes


def test_export_capture_emits_hooks_module():
    src, plan = compile_source(tiny(), "mesh node(2) > gpu(2)\nparams shard over world\ngrads shard over world\n"
                               "optim shard over world\n", example_inputs=(torch.zeros(2, 8, dtype=torch.long),),
                               capture="export")
    assert plan.capture == "export"
    assert "hooks=True" in src and "def forward" not in src and "Export capture" in src
    compile(src, "export", "exec")
    assert "Stage(unit=1, issue=(2,))" in src and "schedule=SCHEDULE" in src


class _EchoRuntime:
    """Stands in for the runtime: records calls, runs units directly (params stay local)."""
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args[0] if args and isinstance(args[0], int) else None))
            if name == "run_unit":
                return args[1](*args[2:])
            return args[0] if name == "end_forward" else None
        return call


@pytest.mark.parametrize("units", ["units auto", 'units type MLP', 'units "transformer.h.*.attn", "lm_head"'])
def test_emitted_forward_computes_the_model(units):
    """The printed graph code is the model's forward: same output bits, unit calls in order."""
    from types import SimpleNamespace
    text = f"mesh gpu(2)\nparams shard over gpu\ngrads shard over gpu\noptim shard over gpu\n{units}\n"
    model = tiny()
    src, plan = compile_source(model, text, capture="fx")
    ns = load_emitted(src, "echo")
    rt = _EchoRuntime()
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ns["forward"](SimpleNamespace(module=model, runtime=rt), x), model(x))
    runs = [u for name, u in rt.calls if name == "run_unit"]
    assert runs == list(range(1, len(plan.units)))
    assert rt.calls[0] == ("begin_forward", None) and rt.calls[-1][0] == "end_forward"


SHIPPED = sorted(f for f in os.listdir(os.path.join(regen_emitted.ROOT, "examples", "strategies")) if f.endswith(".shard"))


@pytest.mark.parametrize("file", SHIPPED)
def test_every_shipped_strategy_emits_valid_code(file):
    mesh = "node(2) > gpu(2) > gcd(2)" if file == "zero_topo.shard" else "node(2) > gpu(2)"
    src, plan = compile_source(tiny(), os.path.join(regen_emitted.ROOT, "examples", "strategies", file),
                               capture="fx", mesh=mesh)
    compile(src, file, "exec")
    sharded = plan.strategy.mesh.factor(plan.strategy.params.levels) > 1
    assert ("rt.wait_gather(1)" in src) == sharded          # gathers exactly when params are sharded
    assert src.count("rt.run_unit(") == len(plan.units) - 1
