"""The `shardc` command line: parses the subcommand and hands off to its module.

Each subcommand lives in `shardc.compiler.cmd_<name>` and exposes
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
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardc", description="A compiler for data-parallel training strategies.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_ in COMMANDS.items():
        mod = importlib.import_module(f"shardc.compiler.cmd_{name}")
        sp = sub.add_parser(name, help=help_, description=help_)
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    from shardc.dsl.errors import ShardcError

    args = _parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ShardcError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
