"""torch.compile boundaries — stage: runtime. Which runtime code torch.compile must not trace.

Input: the runtime's forward entry points (eager/engine.py, module.py). Output: `eager` and
`eager_frame`, decorators that make dynamo graph-break around them.

[Note: graph breaks at unit boundaries]
The runtime's forward bookkeeping (gathers, waits, releases, swapping the parameter
views in, arming the backward hooks) is Python with side effects on engine state,
c10d collectives and storage resizes: dynamo must run it, not trace it. Traced, it
recompiles on every change of engine state it guards on, and the storage resize reaches
Inductor as `resize_storage_bytes_` of a dynamic size, which it cannot lower. So every
entry point the model's forward reaches is `eager` (torch.compiler.disable, recursive:
nothing below it is traced either); dynamo graph-breaks at each call and compiles the
code between them. `run_unit(i, fn, *args)` is `eager_frame`: its own frame runs eagerly
(its bookkeeping calls are `eager` themselves) but the unit's module it calls is a new
frame dynamo compiles, once per code object (every block of a model shares one graph;
its parameters are graph inputs, not constants). FSDP2 marks its hooks the same way
(`_fsdp_common._dynamo_disable`).

[Note: compile, then shard]
`shard_model(torch.compile(model))` (nanoGPT's order) shards the module torch.compile
wrapped, under its own names (no `_orig_mod.` prefix in parameter names, state dicts or
the emitted PARAMS), and compiles the sharded module's calls with the same compile
context: the same as `sm.compile()` on `sm = shard_model(model)`: the result is the ShardedModule
itself. Sharding the OptimizedModule instead would trace the model's own
forward with the unit hooks in it: its loop over the blocks graph-breaks at every block,
and a graph break inside a loop makes dynamo run that whole frame eagerly (the root
unit's code: embeddings, final norm, the tied head), compiling only the blocks.

[Note: the root unit on the hooks path]
With fx capture the emitted forward is straight-line code (fx unrolled the model's
loops), so dynamo compiles the root unit's code between the runtime's graph breaks, in
a few graphs. On the hooks path (export capture: the model's own forward runs) a frame
that loops over the units is run eagerly by dynamo (a graph break in a loop skips the
frame), so the root unit's code in that frame would run eagerly (FSDP2 has the same
limit). Where shardc knows the compile settings (compile, then shard; `sm.compile()`),
it compiles each module holding root-unit parameters on its own (`forward` wrapped, so
each class has its own code object and cache): where dynamo traces the frame anyway,
it inlines them; where it skips the frame, they still run compiled. Code between them
in a skipped frame (an add, a rotary table) stays eager. `torch.compile(sm)` gives
shardc no settings to reuse: there, such a frame's root modules run eagerly.
"""
from __future__ import annotations

import torch


REASON = ("shardc runtime: gathers, releases and parameter views run eagerly between compiled "
          "graphs (fullgraph=True cannot hold them)")


def eager(fn):
    """Run `fn` (and everything it calls) eagerly under torch.compile: a graph break."""
    return torch.compiler.disable(fn, recursive=True, reason=REASON)


def eager_frame(fn):
    """Run `fn`'s own frame eagerly; the functions it calls may still be compiled."""
    return torch._dynamo.disable(fn, recursive=False, reason=REASON)


def split_compiled(model):
    """`(module, ctx)`: the module `torch.compile(module)` wrapped and its compile context,
    or `(model, None)` for a model that is no OptimizedModule. See [Note: compile, then shard]."""
    from torch._dynamo.eval_frame import OptimizedModule
    if isinstance(model, OptimizedModule):
        return model._orig_mod, model.dynamo_ctx
    return model, None


def compile_like(sm, ctx) -> None:
    """Compile `sm`'s calls with `ctx` (fn -> compiled fn: the user's torch.compile
    settings), in place, the way `nn.Module.compile()` does: `sm` stays a ShardedModule
    with its own names. On the hooks path the root unit's modules are compiled on their
    own too (see [Note: the root unit on the hooks path])."""
    if ctx is None:
        return
    sm._compiled_call_impl = ctx(sm._call_impl)
    if sm.hooks:
        for m in root_modules(sm):
            m.forward = ctx(m.forward)


def root_modules(sm) -> list:
    """The modules that hold the root unit's parameters (a tied one under each name)."""
    out = []
    for group in sm.runtime.units[0].targets:
        for slot in group:
            for mod, _ in slot:
                if not any(m is mod for m in out):
                    out.append(mod)
    return out
