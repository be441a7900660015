"""`shardc simulate --ep` (issue 48 item 3, in part): the flag replaces the `experts`
statement's ep as explain's and plan's do, so a simulated rank builds the experts' mesh of
that degree; a factory whose experts are plain tensors gets the one sentence that names
this rank's ep group and how to place them."""
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
