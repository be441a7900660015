"""Several bandwidth profiles merged: `explain/plan --bandwidth A --bandwidth B ...` and
`bench/predict.py --profile` ([Note: merged profiles], analysis/costmodel/profile_merge.py).

The inputs are the hand-written predict fixture (tests/golden/predict/profile.json) with
every collective's seconds and CPU seconds, and the compute run's, scaled by hand: the
merge of three scaled copies must predict exactly as a fourth copy built with the
per-entry medians, and differently from any one of the three.
"""
from __future__ import annotations

import json
import os

import pytest

from tests.bench_modules import load_bench as _bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "golden", "predict")
BENCH = os.path.join(ROOT, "bench", "models.py") + ":bench"
EXPLAIN = ["explain", os.path.join(ROOT, "examples", "strategies", "hsdp_zero2.shard"), "--model", BENCH,
           "--mesh", "node(2) > gpu(4)", "--micro-batches", "4", "--tokens", "128", "--seq", "64", "--json"]


def _fixture() -> dict:
    with open(os.path.join(FIX, "profile.json")) as f:
        return json.load(f)


def _scaled(tmp_path, name: str, wall: float, cpu: float, edit=None) -> str:
    """The fixture with every measured wall time × `wall` and CPU time × `cpu`."""
    doc = _fixture()
    for e in doc["entries"]:
        e["seconds"] *= wall
        e["cpu_seconds"] *= cpu
    c = doc["compute"]
    c["seconds"] *= wall
    c["cpu_seconds"] *= cpu
    c["flops_per_s"] = c["flops"] / c["seconds"]
    if edit:
        edit(doc)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture
def three(tmp_path):
    """Three profiles whose medians come from different files (wall: B, CPU: A, ...)
    and the profile of those medians, built by hand."""
    files = [_scaled(tmp_path, "a", 1.0, 2.0), _scaled(tmp_path, "b", 3.0, 1.0), _scaled(tmp_path, "c", 2.0, 3.0)]
    return files, _scaled(tmp_path, "median", 2.0, 2.0)


def _explain(capsys, profiles) -> dict:
    from shardc.cli import main
    capsys.readouterr()
    assert main(EXPLAIN + [a for p in profiles for a in ("--bandwidth", p)]) == 0
    return json.loads(capsys.readouterr().out)["time"]


def test_merged_profile_is_the_median_of_each_entry(three):
    from shardc.analysis.costmodel.profile import Profile
    files, median = three
    merged, want = Profile.load(*files), Profile.load(median)
    assert merged.entries == want.entries
    assert merged.flops == pytest.approx(want.flops, rel=1e-12) and merged.cpu_share == pytest.approx(want.cpu_share)
    assert str(merged).startswith("bandwidth profile (median of 3 files, ")


def test_explain_with_several_profiles_predicts_as_their_median(three, capsys):
    files, median = three
    got, want = _explain(capsys, files), _explain(capsys, [median])
    assert got["total"] == pytest.approx(want["total"], rel=1e-12)
    assert got["compute"] == pytest.approx(want["compute"], rel=1e-12)
    # c shares the median's wall times (scaling every CPU time alike leaves the occupied
    # share unchanged: u·r with r = compute wall / CPU), so a and b are the checks
    assert all(abs(_explain(capsys, [f])["total"] / want["total"] - 1) > 0.05 for f in files[:2])


def test_predict_merges_its_profiles(three):
    predict = _bench("predict")
    files, median = three
    with open(os.path.join(FIX, "systems.json")) as f:
        doc = json.load(f)
    got = {r["system"]: r["predicted_s"] for r in predict.table(files, doc)}
    want = {r["system"]: r["predicted_s"] for r in predict.table(median, doc)}
    assert got.keys() == want.keys() and all(got[k] == pytest.approx(want[k], rel=1e-12) for k in got)


def _drop_entry(doc):
    doc["entries"].pop(0)


def _other_mesh(doc):
    doc["mesh"] = [{"name": "node", "size": 4}, {"name": "gpu", "size": 2}]


def _other_compute(doc):
    doc["compute"]["tokens"] = 256


@pytest.mark.parametrize("edit, says", [
    (_drop_entry, "has no all_gather over gpu (ring, fp32, 100000 bytes) entry"),
    (_other_mesh, "was measured on mesh node(4) > gpu(2)"),
    (_other_compute, "timed the compute with tokens 256"),
])
def test_unlike_profiles_are_refused_naming_the_file(tmp_path, capsys, edit, says):
    from shardc.cli import main
    a, b = _scaled(tmp_path, "a", 1.0, 1.0), _scaled(tmp_path, "odd", 1.0, 1.0, edit)
    assert main(EXPLAIN + ["--bandwidth", a, "--bandwidth", b]) != 0
    err = capsys.readouterr().err
    assert says in err and "odd.json" in err and "Traceback" not in err


def test_the_merge_ignores_file_order_and_a_repeated_file(three):
    # A median does not depend on the order of its samples, and merging a file with
    # itself changes nothing.
    import itertools
    from shardc.analysis.costmodel.profile import Profile
    files, median = three
    merged = [Profile.load(*order).entries for order in itertools.permutations(files)]
    assert all(m == merged[0] for m in merged)
    assert Profile.load(median, median, median).entries == Profile.load(median).entries
