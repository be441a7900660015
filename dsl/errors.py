"""Base error type shared by every stage (dsl, compiler, runtime).

A `ShardcError` is a user mistake: the CLI prints `error: <message>` (no traceback) and
exits 1. Its message is one clear sentence naming the culprit. Strategy-file problems
use `shardc.dsl.diagnostics.StrategyError`, a subclass carrying rustc-style diagnostics.
"""


class ShardcError(Exception):
    """A user-facing error: bad strategy, bad model, bad configuration."""
