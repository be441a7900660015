"""The `shardc` command line: parses the subcommand and hands off to its module.

Each subcommand lives in `shardc.cli.cmd_<name>` and exposes
`add_arguments(parser)` and `run(args) -> int`. A `ShardcError` from any stage is a
user mistake: it is printed as one line (`error: ...`) and the exit code is 1; argparse
usage errors exit 2. No user mistake ever shows a Python traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "check": "validate a .shard strategy file",
    "explain": "predict memory and communication of a strategy on a model",
    "compile": "emit a distributed training module for a model",
    "plan": "search every valid strategy on a mesh and rank them",
    "profile": "measure collective bandwidth (run under torchrun)",
    "simulate": "run ranks of a big job in one process (fake process group) beside explain",
}


def _parser(argv: list[str]) -> argparse.ArgumentParser:
    """Only the chosen subcommand's module is imported, so one command's heavy imports
    (or a problem in it) never affect another."""
    p = argparse.ArgumentParser(prog="shardc", description="A compiler for data-parallel training strategies.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, help_ in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:
            mod = importlib.import_module(f"shardc.cli.cmd_{name}")
            mod.add_arguments(sp)
            sp.set_defaults(_run=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    from shardc.dsl.diagnostics import StrategyError
    from shardc.dsl.errors import ShardcError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser(argv).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except StrategyError as e:       # already rendered rustc-style, one block per diagnostic
        print(str(e), file=sys.stderr)
        return 1
    except ShardcError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
