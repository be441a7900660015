"""`shardc plan`: the search space, the memory filter, and the written `.shard`."""
from __future__ import annotations

import argparse
import importlib
import json

import pytest

from shardc.dsl.ir import Level, Mesh

LLAMA = "examples/llama.py:llama_tiny"


def run_cmd(name: str, argv: list[str]) -> int:
    """Run `shardc NAME ARGV` through the command module, as shardc.cli does."""
    mod = importlib.import_module(f"shardc.cli.cmd_{name}")
    p = argparse.ArgumentParser(prog=f"shardc {name}")
    mod.add_arguments(p)
    return mod.run(p.parse_args(argv))


def test_enumeration_count_by_hand():
    from shardc.analysis.planner import enumerate_scopes
    two = Mesh((Level("node", 2), Level("gpu", 4)))
    # Each level is, independently, in no scope / optim only / grads+optim / all three
    # (params ⊆ grads ⊆ optim): 4 choices per level -> 4·4 = 16 on a 2-level mesh.
    scopes = enumerate_scopes(two)
    assert len(scopes) == 16
    assert len({(s.params.levels, s.grads.levels, s.optim.levels) for s in scopes}) == 16
    # Spelled out: P ⊆ G ⊆ OS over {node, gpu}; for OS = {} 1, {node} 3, {gpu} 3, and for
    # OS = {node, gpu}: G ∈ {}, {node}, {gpu}, {node,gpu} with 1 + 2 + 2 + 4 P choices = 9.
    assert 1 + 3 + 3 + 9 == 16
    three = Mesh((Level("node", 2), Level("gpu", 2), Level("gcd", 2)))
    assert len(enumerate_scopes(three)) == 4 ** 3
    for s in enumerate_scopes(three):
        assert set(s.params.levels) <= set(s.grads.levels) <= set(s.optim.levels)


def test_best_plan_fits_obeys_rule_and_checks(tmp_path, capsys):
    out = tmp_path / "best.shard"
    # llama_tiny: 10,314 parameters; DDP with AdamW in fp32 holds 16 bytes each = 165,024 bytes,
    # plus 50,160 bytes of activations at 16 tokens and the backward's gradients beside them, so
    # a 200,000-byte budget must shard something (the peak is explain's memory timeline's).
    budget = 200_000
    rc = run_cmd("plan", ["--model", LLAMA, "--mesh", "node(2) > gpu(2)", "--memory", f"{budget}B",
                          "--micro-batches", "2", "--top", "5", "-o", str(out), "--json",
                          "--tokens", "16", "--overhead", "0"])   # model states, gathered units, activations
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["candidates"] == 16 and 0 < doc["fit"] < 16
    best = doc["ranking"][0]
    assert best["memory"] == best["peak"]["peak"] <= budget and best["peak"]["activations"] == 50_160
    assert set(best["params"]) <= set(best["grads"]) <= set(best["optim"])
    times = [r["step_seconds"] for r in doc["ranking"]]
    assert times == sorted(times)
    assert run_cmd("check", [str(out)]) == 0
    import shardc
    s = shardc.load_strategy(str(out))
    assert (list(s.params.levels), list(s.grads.levels), list(s.optim.levels)) == \
        (best["params"], best["grads"], best["optim"])
    assert s.accumulate == 2 and str(s.mesh) == "node(2) > gpu(2)"
    # the planner's figure is explain's peak: the memory timeline's maximum, at least the
    # states, the gathered window and the activations held at once at the forward's end
    pk = best["peak"]
    assert best["memory"] >= pk["states"] + pk["gathered"] + pk["activations"]


def test_plan_never_filters_by_a_peak_without_activations(tmp_path):
    # --memory bounds the peak, activations included: without them (--no-graph, a model
    # the meta trace cannot run) there is no peak, and plan says so in one sentence
    # instead of ranking what fits a sum that left them out.
    from shardc.dsl.errors import ShardcError
    argv = ["--mesh", "node(2) > gpu(2)", "--memory", "1GiB"]
    with pytest.raises(ShardcError, match=r"^--no-graph leaves the activations out, but plan keeps the strategies "
                                          r"whose peak memory \(activations included\) fits --memory: drop --no-graph$"):
        run_cmd("plan", ["--model", LLAMA, "--no-graph", *argv])
    (tmp_path / "branchy.py").write_text(
        "import torch\nfrom torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.e = nn.Embedding(8, 4)\n"
        "    def forward(self, x):\n        y = self.e(x)\n        return y[y > 0]   # no shape on meta tensors\n"
        "def build():\n    return M()\n")
    with pytest.raises(ShardcError) as e:
        run_cmd("plan", ["--model", f"{tmp_path / 'branchy.py'}:build", *argv])
    assert " does not trace on the meta device (" in str(e.value) and str(e.value).endswith("fits --memory")
    from shardc.analysis.planner import plan
    with pytest.raises(ShardcError, match="needs the model's traced graph"):
        plan(None, [], 2**30)


def test_bf16_plan_writes_loadable_dtypes(tmp_path, capsys):
    out = tmp_path / "best.shard"
    assert run_cmd("plan", ["--model", LLAMA, "--mesh", "node(2) > gpu(2)", "--memory", "3GiB",
                            "--precision", "bf16", "-o", str(out)]) == 0
    import shardc
    s = shardc.load_strategy(str(out))
    assert s.params.dtype.value == "bf16" and s.grads.dtype.value == "bf16"
    assert "strategies obey the dependency rule" in capsys.readouterr().out


def test_nothing_fits_is_one_clear_error(tmp_path):
    from shardc.dsl.errors import ShardcError
    with pytest.raises(ShardcError, match="no strategy fits 1000B per rank"):
        run_cmd("plan", ["--model", LLAMA, "--mesh", "node(2) > gpu(2)", "--memory", "1000B", "--overhead", "0"])
    with pytest.raises(ShardcError, match="cannot read memory size"):
        run_cmd("plan", ["--model", LLAMA, "--mesh", "node(2) > gpu(2)", "--memory", "lots"])
    with pytest.raises(ShardcError, match=r"memory size '80' has no unit; write e\.g\. 80GiB or 80GB"):
        run_cmd("plan", ["--model", LLAMA, "--mesh", "node(2) > gpu(2)", "--memory", "80"])
    with pytest.raises(ShardcError, match=r"memory size '0GiB' must be positive"):
        run_cmd("plan", ["--model", LLAMA, "--mesh", "node(2) > gpu(2)", "--memory", "0GiB"])


def test_nothing_fits_names_what_dominates_and_prints_no_empty_table(capsys):
    # llama_tiny at 4096 tokens: activations are most of every layout's peak, so the
    # error names them and the flag that shrinks them; with --checkpoint it does not
    # suggest --checkpoint again.
    from shardc.dsl.errors import ShardcError
    argv = ["--model", LLAMA, "--mesh", "node(2) > gpu(2)", "--memory", "1MiB", "--overhead", "0"]
    with pytest.raises(ShardcError, match=r"dominated by activations \(--checkpoint recomputes them\)$"):
        run_cmd("plan", argv)
    out = capsys.readouterr().out
    assert "0 fit 1 MiB" in out and "top 0" not in out and "┏" not in out
    with pytest.raises(ShardcError) as e:
        run_cmd("plan", [*argv, "--checkpoint"])
    assert "--checkpoint" not in str(e.value)


def test_compute_bound_ties_go_to_the_least_communication(capsys):
    # 1 MFLOP/s: compute hides every collective but microseconds of tail ([Note: sync
    # overlap]) under a 34,649 s step, so the step times tie to 6 significant digits (the
    # planner's resolution) and Lins' objective (communication time) orders them.
    assert run_cmd("plan", ["--model", LLAMA, "--mesh", "node(2) > gpu(2)", "--memory", "3GiB",
                            "--flops", "1e6", "--top", "16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["ranking"]
    assert len(rows) == 16
    steps = [float(f"{r['step_seconds']:.6g}") for r in rows]
    assert len(set(steps)) == 1 and len({r["step_seconds"] for r in rows}) > 1   # tied, not equal
    comm = [r["comm_seconds"] for r in rows]
    assert comm == sorted(comm) and comm[0] < comm[-1]
