"""`shardc simulate --ep` (issue 48 item 3, in part): the flag replaces the `experts`
statement's ep as explain's and plan's do, so a simulated rank builds the experts' mesh of
that degree; a factory whose experts are plain tensors gets the one sentence that names
this rank's ep group and how to place them; a factory that takes `ep_mesh` gets the rank's
ep mesh, and examples/moe.py's dispatch runs on meta tensors (a fixed, balanced routing)
with states and ledger equal to explain's."""
from __future__ import annotations

import os

from tests.test_runtime_util import ROOT

MOE = """mesh node(2) > gpu(4)
params shard over world
grads  shard over world
optim  shard over world
experts "*.experts"
"""


def test_simulate_takes_ep(capsys, tmp_path):
    from shardc.cli import main
    (tmp_path / "moe.shard").write_text(MOE)
    argv = ["simulate", str(tmp_path / "moe.shard"), "--model", os.path.join(ROOT, "examples/moe.py:moe_tiny"),
            "--ep", "2", "--rank", "2", "--micro-batches", "1", "--tokens", "16", "--no-graph", "--no-peak"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    # rank 2's ep group under ep 2: the innermost gpu ranks 2 and 3
    assert "with `ep 2` the experts of this rank's ep group live on ranks [2, 3]" in err, err


def test_meta_dispatch_runs_and_equals_explain():
    """examples/moe.py's dispatch on meta tensors (the balanced routing of [Note: the dispatch
    on meta tensors]) under `shardc simulate` at 16 ranks: the factory takes the rank's ep
    mesh and places its experts there; each block's two all-to-alls carry this rank's
    tokens x top-k rows of D fp32 values, and the rank's states and ledger equal explain's
    under ep over the whole gpu level and under ep 2."""
    import shardc
    from examples.moe import TINY, moe_tiny_ep
    from shardc.simulate import simulate_rank
    for name, rank in (("ep_zero3", 0), ("ep2_zero3", 13)):
        s = shardc.load_strategy(os.path.join(ROOT, "examples/strategies/moe", f"{name}.shard"),
                                 mesh="node(4) > gpu(4)")
        built = []

        def factory(ep_mesh=None):
            built.append(moe_tiny_ep(ep_mesh))
            return built[-1]
        rep = simulate_rank(s, factory, rank, batch=1, seq=16, micro_batches=1, peak=False)
        assert rep["memory_equal"] and rep["ledger_equal"], (name, rep["memory"], rep["explain_memory"])
        model = built[-1]                            # the one that ran: built with the ep mesh
        ep = 4 if name == "ep_zero3" else 2
        assert model.layers[0].moe.experts.w1.to_local().shape[0] == TINY.n_experts // ep
        rows = 16 * TINY.top_k                       # one micro-batch of one 16-token sequence, one step
        for layer in model.layers:
            assert layer.moe.experts.dispatched_bytes == 2 * rows * TINY.dim * 4
