"""Argument types shared by the `shardc` subcommands (CLI stage: argv -> typed values).

Each raises `argparse.ArgumentTypeError`, which argparse turns into a usage error (exit 2).
"""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n
