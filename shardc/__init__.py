"""shardc — a compiler for data-parallel training strategies in PyTorch.

Public API (docs/internals.md): `load_strategy`, `compile`, `distributed`, `ShardcError`.
Imports are lazy so `import shardc` stays cheap for the CLI.
"""
from shardc.dsl.errors import ShardcError

__all__ = ["ShardcError", "load_strategy", "compile", "distributed", "buffers_only", "load_safetensors", "checkpoint_errors",
           "from_deepspeed_config", "load_deepspeed", "save_deepspeed"]
__version__ = "0.1.0"


def load_strategy(path_or_text, world_size=None, mesh=None, ep=None):
    """Parse and check a `.shard` file (a path, or the text itself) into a Strategy; `mesh`
    replaces its mesh line, `ep` (a number or a level) its `experts` statement's ep."""
    from shardc.dsl import load_strategy as _load
    return _load(path_or_text, world_size=world_size, mesh=mesh, ep=ep)


def compile(model, strategy, example_inputs=None, capture="auto", mesh=None, timeout=None,  # noqa: A001
            passes=None, backend="eager", init=None, device=None):
    """Compile `model` under `strategy` into a ShardedModule (run under torchrun).

    `timeout` (seconds; default $SHARDC_TIMEOUT or 600) bounds every wait on a peer (see
    docs/checkpoints.md); `passes` names the plan passes to run (None: all, `()`: none;
    see `shardc.lowering.passes`); `backend="inductor"` compiles the whole step (each
    micro-batch's forward and backward one Inductor graph, collectives included, and the
    step's sync and update one more; docs/compiler.md "The whole-step compiled mode").

    A model built on the meta device (`with torch.device("meta"): model = ...`) is never
    built whole: each rank allocates its shards and `init`, called per module in
    `model.apply`'s order (default: each module's `reset_parameters()`), fills them, giving
    the values one process's `model.to_empty(...); model.apply(init)` would, whatever the
    world size (seed with `torch.manual_seed` right before this call); `init=False` leaves
    them to a load (DCP, `sm.load_state_dict`, `shardc.load_safetensors`). `device`: where the
    shards live (default: the model's; on meta, the mesh's). See docs/checkpoints.md."""
    from shardc.api import compile_model
    return compile_model(model, strategy, example_inputs=example_inputs, capture=capture, mesh=mesh,
                         timeout=timeout, passes=passes, backend=backend, init=init, device=device)


def buffers_only(fn):
    """`shardc.compile(meta_model, ..., init=shardc.buffers_only(fn))`: `fn` runs per module
    with the parameters left without values (a checkpoint loads them next), so only buffers
    get values (Hugging Face's `model._init_weights` recomputes rotary caches that way)."""
    from shardc.runtime.state.init import BuffersOnly
    return BuffersOnly(fn)


def load_safetensors(sm, path, strict=False, dtype="strategy"):
    """Load a `save_pretrained` directory (or one .safetensors file) straight into the shards
    of `sm` (a ShardedModule): each rank reads only the slices it keeps, through torch's DCP
    with its `HuggingFaceStorageReader`, from the files the directory's index names.
    `strict`: tensors the model lacks are an error (default: ignored). Collective. A bad
    checkpoint is one sentence and loads nothing. `dtype`: "strategy" casts to the
    strategy's params dtype, "checkpoint" keeps the files' (see docs/checkpoints.md)."""
    from shardc.runtime.state.hf import load_safetensors as _load
    return _load(sm, path, strict=strict, dtype=dtype)


def checkpoint_errors(where, model=None):
    """`with shardc.checkpoint_errors(path, model=sm): dcp.load(state, checkpoint_id=path)` — a
    failed DCP load (torch's CheckpointException, every rank's traceback) becomes one
    sentence naming the tensor, the saved and the expected shape; a failure while reading
    (after some pieces were written) says so and, with `model`, marks its parameters as
    without values until a load succeeds. See docs/checkpoints.md."""
    from shardc.runtime.state.load_errors import checkpoint_errors as _errors
    return _errors(where, model)


def from_deepspeed_config(config, mesh="node(*) > gpu(local)"):
    """The `.shard` text doing what a ds_config dict's ZeRO section does (docs/deepspeed.md)."""
    from shardc.deepspeed import from_deepspeed_config as _conv
    return _conv(config, mesh=mesh)


def load_deepspeed(sm, opt, path, tag=None, work_dir=None):
    """Resume `sm` and `opt` from a DeepSpeed ZeRO-1/2/3 checkpoint directory, read by
    DeepSpeed's own ds_to_universal (needs the `deepspeed` extra). Collective. See
    docs/deepspeed.md."""
    from shardc.deepspeed import load_deepspeed as _load
    return _load(sm, opt, path, tag=tag, work_dir=work_dir)


def save_deepspeed(ckpt, path, tag="from_shardc"):
    """Write the shardc DCP checkpoint `ckpt` as a DeepSpeed universal checkpoint at `path`
    (parameters and AdamW's moments and step), which DeepSpeed loads with
    `"checkpoint": {"load_universal": true}`. One process. See docs/deepspeed.md."""
    from shardc.deepspeed_universal import dcp_to_deepspeed
    return dcp_to_deepspeed(ckpt, path, tag=tag)


def distributed(backend=None, **init_kwargs):
    """`with shardc.distributed(): ...` — the block runs on a default process group made so
    that the job survives `torchrun --max-restarts` (fresh rendezvous keys after a restart;
    at the end: garbage collected, the group destroyed and, under torchrun, the process
    ended with the block's exit status, skipping interpreter teardown). An existing default
    group is used and left alone. See shardc/launch.py."""
    from shardc.launch import distributed as _distributed
    return _distributed(backend, **init_kwargs)
