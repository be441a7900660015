"""bench: `cluster_bench.py --rounds` pools a system's rounds into one summary
(bench/report.py `merge_rounds`, [Note: rounds])."""
from __future__ import annotations

import os

import pytest

from tests.bench_modules import load_bench


def _round(times, tokens_per_step=1000.0):
    times = list(times)
    med = sorted(times)[len(times) // 2]
    return {"step_time_s": med, "tokens_per_s": tokens_per_step / med, "step_times": times,
            "splits": [[t / 2, t / 2] for t in times], "model_state_bytes": 7, "level_bytes": {"node": 3.0}}


def test_rounds_pool_every_step():
    merged = load_bench("report").merge_rounds([_round([4.0, 5.0, 9.0]), _round([4.5, 4.6, 4.7])])
    assert merged["step_times"] == [4.0, 5.0, 9.0, 4.5, 4.6, 4.7]
    assert merged["step_time_s"] == pytest.approx((4.6 + 4.7) / 2)     # median of the six
    assert merged["tokens_per_s"] == pytest.approx(1000.0 / merged["step_time_s"])
    assert merged["round_step_s"] == [5.0, 4.6]
    assert merged["splits"] == [[t / 2, t / 2] for t in merged["step_times"]]
    assert merged["model_state_bytes"] == 7 and merged["level_bytes"] == {"node": 3.0}


def test_a_failed_round_fails_the_system():
    err = {"error": "timed out after 600s", "log_tail": "..."}
    assert load_bench("report").merge_rounds([_round([4.0, 5.0, 6.0]), err]) == err


def test_rounds_must_be_positive(capsys):
    mod = load_bench("cluster_bench")
    assert mod.main(["--rounds", "0", "--json", os.devnull]) == 1
    assert "--rounds" in capsys.readouterr().err
