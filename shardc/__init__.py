"""shardc — a compiler for data-parallel training strategies in PyTorch.

Public API (docs/internals.md): `load_strategy`, `compile`, `distributed`, `ShardcError`.
Imports are lazy so `import shardc` stays cheap for the CLI.
"""
from shardc.dsl.errors import ShardcError

__all__ = ["ShardcError", "load_strategy", "compile", "distributed"]
__version__ = "0.1.0"


def load_strategy(path_or_text, world_size=None, mesh=None):
    """Parse and check a `.shard` file (a path, or the text itself) into a Strategy."""
    from shardc.dsl import load_strategy as _load
    return _load(path_or_text, world_size=world_size, mesh=mesh)


def compile(model, strategy, example_inputs=None, capture="auto", mesh=None, timeout=None,  # noqa: A001
            passes=None, backend="eager"):
    """Compile `model` under `strategy` into a ShardedModule (run under torchrun).

    `timeout` (seconds; default $SHARDC_TIMEOUT or 600) bounds every wait on a peer (see
    docs/checkpoints.md); `passes` names the plan passes to run (None: all, `()`: none;
    see `shardc.lowering.passes`); `backend="inductor"` compiles the whole step (each
    micro-batch's forward and backward one Inductor graph, collectives included, and the
    step's sync and update one more; docs/compiler.md "The whole-step compiled mode")."""
    from shardc.api import compile_model
    return compile_model(model, strategy, example_inputs=example_inputs, capture=capture, mesh=mesh,
                         timeout=timeout, passes=passes, backend=backend)


def distributed(backend=None, **init_kwargs):
    """`with shardc.distributed(): ...` — the block runs on a default process group made so
    that the job survives `torchrun --max-restarts` (fresh rendezvous keys after a restart;
    at the end: garbage collected, the group destroyed and, under torchrun, the process
    ended with the block's exit status, skipping interpreter teardown). An existing default
    group is used and left alone. See shardc/launch.py."""
    from shardc.launch import distributed as _distributed
    return _distributed(backend, **init_kwargs)
