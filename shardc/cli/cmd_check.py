"""`shardc check FILE [--world N] [--mesh M] [--json]` — validate a strategy file.

Input: a `.shard` file; output: exit 0 when valid (warnings rendered on stderr, and with
`--json` the resolved strategy on stdout), 1 when invalid (every diagnostic rendered
rustc-style on stderr, including a missing or unreadable file), 2 for usage errors
(argparse).
"""
from __future__ import annotations

import argparse
import json
import sys

from shardc.cli.argtypes import positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the .shard strategy file")
    p.add_argument("--world", type=positive_int, default=None, metavar="N",
                   help="world size (resolves `*` and checks the mesh product)")
    p.add_argument("--mesh", default=None, metavar="M",
                   help='replace the file\'s mesh, e.g. "node(2) > gpu(2) > gcd(2)"')
    p.add_argument("--json", action="store_true", help="print the resolved strategy as JSON")


def run(args: argparse.Namespace) -> int:
    from shardc.dsl import StrategyError, load_strategy
    from shardc.dsl.errors import ShardcError
    from shardc.dsl.serialize import strategy_dict

    try:
        strategy = load_strategy(_as_path(args.file), world_size=args.world, mesh=args.mesh)
    except StrategyError as e:
        print(str(e), file=sys.stderr)
        n = len(e.errors)
        print(f"\n{args.file}: {n} error{'s' if n != 1 else ''}", file=sys.stderr)
        return 1
    except ShardcError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for w in strategy.warnings:
        print(w + "\n", file=sys.stderr)
    if args.json:
        print(json.dumps(strategy_dict(strategy), indent=2))
    else:
        print(f"{args.file}: ok ({strategy.name}, mesh {strategy.mesh}"
              f"{f', {len(strategy.warnings)} warning(s)' if strategy.warnings else ''})")
    return 0


def _as_path(file: str):
    from pathlib import Path
    return Path(file)
