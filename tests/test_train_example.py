"""examples/train_gpt.py: the README's main job trains (loss falls) and reports.

Runs the script's `train(args)` on a 4-rank gloo world (the same code torchrun runs,
minus process-group set-up) with the tiny model for a few steps under paro_iig.
"""
import os

import pytest

from tests.harness import dist_run

pytestmark = pytest.mark.distributed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job(rank, world, argv, capture_stderr=False):
    import contextlib
    import importlib.util
    import io
    spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(ROOT, "examples", "train_gpt.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    err = io.StringIO()
    with contextlib.redirect_stderr(err) if capture_stderr else contextlib.nullcontext():
        out = mod.train(mod.parse_args(argv))
    return dict(out, stderr=err.getvalue())


def test_train_gpt_loss_falls_and_reports():
    argv = ["--strategy", os.path.join(ROOT, "examples", "strategies", "paro_iig.shard"),
            "--mesh", "node(2) > gpu(2)", "--model", "tiny", "--steps", "8", "--quiet", "--lr", "1e-2"]
    results = dist_run(4, _job, argv)
    losses = results[0]["losses"]
    assert len(losses) == 8 and all(r["losses"] == losses for r in results)    # all ranks agree
    assert losses[-1] < losses[0] - 0.5, losses
    assert results[0]["tokens_per_s"] > 0
    # paro_iig: per-micro-batch traffic inside a node (gpu), per-step traffic across nodes
    assert set(results[0]["comm"]) >= {"gpu", "node"}
    assert results[0]["comm"]["gpu"] > results[0]["comm"]["node"]
    mem = results[0]["memory"]
    assert mem["total"] == mem["params"] + mem["params_secondary"] + mem["grads"] + mem["optim"]


def test_train_gpt_shows_the_strategys_warnings():
    """A strategy the checker warns about: rank 0 prints the warning before training."""
    argv = ["--strategy", os.path.join(ROOT, "tests", "corpus", "warnings", "partial_scope.shard"),
            "--mesh", "node(2) > gpu(2)", "--model", "tiny", "--steps", "1", "--quiet"]
    results = dist_run(4, _job, argv, True)
    want = open(os.path.join(ROOT, "tests", "golden", "diagnostics", "warnings", "partial_scope.txt")).read()
    first = want.strip().splitlines()[0]
    assert first.startswith("warning:") and first in results[0]["stderr"]
    assert all(first not in r["stderr"] for r in results[1:])          # rank 0 only


def test_train_gpt_with_tensor_parallelism():
    """The README's TP command: 8 ranks as (node 2, gpu 2) x tp 2; each tp pair reads one batch."""
    argv = ["--strategy", os.path.join(ROOT, "examples", "strategies", "paro_iig.shard"),
            "--mesh", "node(2) > gpu(2)", "--tp", "2", "--model", "tiny", "--steps", "6", "--quiet", "--lr", "1e-2"]
    results = dist_run(8, _job, argv)
    losses = results[0]["losses"]
    assert len(losses) == 6 and all(r["losses"] == losses for r in results)
    assert losses[-1] < losses[0] - 0.3, losses
    assert set(results[0]["comm"]) >= {"gpu", "node"}          # shardc's collectives: the dp levels only


def _main(rank, world, argv):
    """The script's `main(argv)` on the harness's group (shardc.distributed() uses it as is);
    its exit status and what it printed."""
    import contextlib
    import importlib.util
    import io
    spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(ROOT, "examples", "train_gpt.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = mod.main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), err.getvalue()


def test_train_gpt_error_is_printed_once_without_a_doubled_prefix():
    # A strategy error: every rank has it; the first prints it once, rendered as the CLI
    # renders it (`error: ...`, not `error: error: ...`), and every rank exits 1.
    argv = ["--strategy", os.path.join(ROOT, "tests", "corpus", "unknown_statement.shard"), "--mesh", "node(2) > gpu(2)",
            "--model", "tiny", "--steps", "1", "--quiet"]
    results = dist_run(4, _main, argv)
    assert [code for code, _, _ in results] == [1] * 4
    assert results[0][2].startswith("error: unknown statement `parms`") and "error: error:" not in results[0][2]
    assert results[0][2].count("error:") == 1 and all(err == "" for _, _, err in results[1:])


def test_train_gpt_progress_counts_from_the_resumed_step(tmp_path):
    # A run of 3 steps saved, then resumed to 5: the progress reads "step 4/5", "step 5/5".
    argv = ["--strategy", os.path.join(ROOT, "examples", "strategies", "zero3.shard"), "--mesh", "gpu(4)",
            "--model", "tiny", "--batch", "1", "--capture", "fx", "--checkpoint-dir", str(tmp_path)]
    assert [r[0] for r in dist_run(4, _main, [*argv, "--steps", "3", "--quiet"])] == [0] * 4
    code, out, _ = dist_run(4, _main, [*argv, "--steps", "5"])[0]
    assert code == 0 and "resumed from" in out
    assert [ln.split(" loss")[0] for ln in out.splitlines() if ln.startswith("step ")] == ["step 4/5", "step 5/5"]
