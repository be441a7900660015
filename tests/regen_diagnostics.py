"""Regenerate tests/golden/diagnostics/<name>.txt from tests/corpus/<name>.shard.

Each corpus file is loaded the way tests/test_dsl_corpus.py loads it: from the
repository root as `tests/corpus/<name>.shard`, world size 8, LOCAL_WORLD_SIZE=4, and
the golden file is the rendered `StrategyError`. Files under tests/corpus/warnings/
must load; their golden (tests/golden/diagnostics/warnings/<name>.txt) is the rendered
warnings. Run: `python tests/regen_diagnostics.py`
(review the diff before committing: the goldens are the specification).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path("tests/corpus")
GOLDEN = ROOT / "tests" / "golden" / "diagnostics"
WORLD = 8
DOCS = ROOT / "docs" / "language.md"
# A marker line, optionally followed by the ```text block it owns.
MARKER = re.compile(r"<!-- diagnostic: ([\w/]+) -->\n(?:\n```text\n.*?\n```\n)?", re.S)


def render(name: str) -> str:
    """The diagnostics of one corpus file: `name` (must fail) or `warnings/name` (must load)."""
    from shardc.dsl import StrategyError, load_strategy

    os.environ["LOCAL_WORLD_SIZE"] = "4"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        s = load_strategy(CORPUS / f"{name}.shard", world_size=WORLD)
    except StrategyError as e:
        if name.startswith("warnings/"):
            raise AssertionError(f"{CORPUS / name}.shard must load (only warnings):\n{e}") from None
        return str(e) + "\n"
    finally:
        os.chdir(cwd)
    if name.startswith("warnings/"):
        assert s.warnings, f"{CORPUS / name}.shard gives no warning"
        return "\n\n".join(s.warnings) + "\n"
    raise AssertionError(f"{CORPUS / name}.shard loaded without errors; a corpus file must be broken")


def names() -> list[str]:
    return sorted(p.stem for p in (ROOT / CORPUS).glob("*.shard"))


def warning_names() -> list[str]:
    return sorted(f"warnings/{p.stem}" for p in (ROOT / CORPUS / "warnings").glob("*.shard"))


def fill_docs(text: str) -> str:
    """docs/language.md with the block after each `<!-- diagnostic: NAME -->` set to NAME's golden."""
    def block(m):
        golden = (GOLDEN / f"{m.group(1)}.txt").read_text()
        return f"<!-- diagnostic: {m.group(1)} -->\n\n```text\n{golden.rstrip()}\n```\n"
    return MARKER.sub(block, text)


def main() -> int:
    (GOLDEN / "warnings").mkdir(parents=True, exist_ok=True)
    every = names() + warning_names()
    for name in every:
        (GOLDEN / f"{name}.txt").write_text(render(name))
    print(f"wrote {len(every)} goldens to {GOLDEN.relative_to(ROOT)}")
    if DOCS.exists():
        DOCS.write_text(fill_docs(DOCS.read_text()))
        print(f"refreshed the example diagnostics in {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
