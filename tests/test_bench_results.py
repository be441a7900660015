"""bench/results holds the runs the docs cite, under one naming scheme (docs/BENCHMARKS.md,
"Result files"): every file is named KIND[_LINK][_MODEL]_DATE[_RUN].EXT and cited by a page
or by a result table a page cites, and every result the pages cite exists."""
from __future__ import annotations

import re
from pathlib import Path

from tests.bench_modules import load_bench

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
KINDS = ("systems", "collectives", "profile", "predict", "collective-models", "torch-profile", "profile-raw")
WORLD_1 = ("overhead", "compile-time", "simulate")    # KINDs of one process: no LINK, no MODEL field
MODELS = tuple(load_bench("models").PRESETS)          # MODEL: `--model`, one of bench/models.py's presets
DATE = r"\d{4}-\d\d-\d\d"
NAME = re.compile(rf"(?:({'|'.join(KINDS)})_(\d+[mg]bit)(_(?:{'|'.join(MODELS)}))?|({'|'.join(WORLD_1)}))"
                  rf"_({DATE})(_[a-z0-9-]+)?\.(json|md|txt|jsonl|jsonl\.gz)")
PAGES = [ROOT / "docs" / "BENCHMARKS.md", ROOT / "docs" / "explain.md", ROOT / "docs" / "simulate.md",
         ROOT / "docs" / "checkpoints.md", ROOT / "README.md"]
CITATION = re.compile(rf"(?:[\w{{}},*-]+_\d+[mg]bit|\b(?:{'|'.join(WORLD_1)})_{DATE})[\w{{}},*.-]*[\w}}*]")
OUTPUTS = ("gpu_trace",)       # written by bench scripts when they run, not shipped


def expand(token: str) -> list[str]:
    """`a_{x,y}.md` -> [`a_x.md`, `a_y.md`] (the docs' brace shorthand)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [e for alt in m.group(1).split(",") for e in expand(token[:m.start()] + alt + token[m.end():])]


def citations(text: str) -> set[str]:
    return {e for tok in CITATION.findall(text) for e in expand(tok)}


def shipped() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir())


def test_every_result_is_named_by_the_scheme():
    assert [n for n in shipped() if not NAME.fullmatch(n)] == []


def test_every_result_is_cited():
    """Results are kept to what the docs cite: a page, or a result table a page cites (a test
    citing a result does not keep it)."""
    by_pages = {c for p in PAGES for c in citations(p.read_text())}
    tables = [p for p in sorted(RESULTS.glob("*.md")) if any(p.match(c) for c in by_pages)]
    cited = {(c, p.name) for p in PAGES + tables for c in citations(p.read_text())}
    uncited = [n for n in shipped() if not any(Path(n).match(c) for c, where in cited if where != n)]
    assert uncited == []


def test_every_cited_result_exists():
    names = shipped()
    missing = [c for p in PAGES for c in citations(p.read_text())
               if not any(Path(n).match(c) for n in names) and not c.startswith(OUTPUTS)]
    assert missing == []


def test_the_model_field_names_a_preset():
    assert NAME.fullmatch("systems_250mbit_medium_2026-11-25_tp.json")
    assert not NAME.fullmatch("systems_250mbit_huge_2026-11-25_tp.json")


def test_world_1_results_have_no_link():
    assert NAME.fullmatch("overhead_2026-11-26_whole-step.json")
    assert NAME.fullmatch("compile-time_2026-11-26_first-step.json")
    assert not NAME.fullmatch("overhead_250mbit_2026-11-26.json")      # no link at world 1
    assert not NAME.fullmatch("systems_2026-11-26.json")               # a cluster run names its link
    assert citations("`bench/results/overhead_2026-11-26_whole-step.json` and compile-time_2026-11-26.json.") == \
        {"overhead_2026-11-26_whole-step.json", "compile-time_2026-11-26.json"}


def test_the_citation_scan_sees_braces_and_globs():
    found = citations("tables `predict_250mbit_bench_2026-11-24_{s1,s2}-on-pooled2.md`, "
                      "`bench/results/torch-profile_250mbit_bench_2026-11-23_{before,after}-issue12-*.txt`.")
    assert found == {"predict_250mbit_bench_2026-11-24_s1-on-pooled2.md", "predict_250mbit_bench_2026-11-24_s2-on-pooled2.md",
                     "torch-profile_250mbit_bench_2026-11-23_before-issue12-*.txt",
                     "torch-profile_250mbit_bench_2026-11-23_after-issue12-*.txt"}
