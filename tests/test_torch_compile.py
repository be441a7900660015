"""torch.compile composes with shardc in every order, and really compiles.

Orders (`ORDERS`): "after" `torch.compile(shardc.compile(model))`; "before"
`shardc.compile(torch.compile(model))` (nanoGPT's); "blocks" `block.compile()` on each
transformer block, then `shardc.compile` (torchtitan's). Each must
- train at parity with one eager process (rel 1e-5; tests/test_compile_parity.py's
  reference), SGD with momentum and AdamW, 2 micro-batches a step, on 4 gloo ranks;
- run as many matmuls inside Inductor graphs per training step as the same order
  without shardc (tests/matmul_count.py), which is every `nn.Linear`'s 3 matmuls (forward,
  input and weight gradient) per micro-batch for a whole-model compile — the root unit's
  tied head included — and the blocks' linears for per-block compile;
- compile nothing new once warm (dynamo's unique graphs stay put from step 2 to step 3).
The example GPT runs the emitted fx forward (`hooks=False`); Llama the export-captured
model's own forward under the runtime's hooks.
"""
import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters

import shardc
from examples.gpt import GPT, TINY
from tests import test_compile_parity as par
from tests import test_hf_models as hf
from tests.harness import dist_run
from tests.matmul_count import MatmulCount

pytestmark = pytest.mark.distributed
ORDERS = ("after", "before", "blocks")
ACC, MESH = 2, "node(2) > gpu(2)"


def strategy_text(name: str) -> str:
    """The shipped strategy, exact (no quantization), planning 2 micro-batches a step."""
    lines = [ln for ln in par._text(name).splitlines() if not ln.startswith("accumulate")]
    return "\n".join(lines + [f"accumulate {ACC}", ""])


def blocks_of(model):
    return model.transformer.h if isinstance(model, GPT) else model.model.layers


def compiled(model, order, backend, shard):
    """`model` trained in `order`; `shard(model)` (None: no shardc) makes the ShardedModule."""
    if order == "blocks":
        for b in blocks_of(model):
            b.compile(backend=backend)
    if order == "before":
        model = torch.compile(model, backend=backend)
    sm = shard(model) if shard is not None else model
    if order == "after":
        sm = torch.compile(sm, backend=backend)
    return sm


def linears(module) -> int:
    return sum(isinstance(m, nn.Linear) for m in module.modules())


def expected_compiled(model, order) -> int:
    """3 matmuls per linear (output, input gradient, weight gradient) per micro-batch."""
    inside = linears(model) if order != "blocks" else sum(linears(b) for b in blocks_of(model))
    return 3 * inside * ACC


def _steps(world):
    return par.batches(world, ACC)


def _gpt_job(rank, world, text, order, opt_kinds):
    out = []
    for opt_kind in opt_kinds:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(123 + rank)                # rank 0's initial weights must win
        model = GPT(TINY) if rank else par.make_model()
        mc = MatmulCount()
        # example inputs: with them `capture auto` could fall back to export (and the hooks
        # path) where fx fails, as it did on a torch.compile'd model; the fx path must be kept
        ex = (torch.zeros(par.MICRO_B, TINY.block_size, dtype=torch.long),)
        sm = compiled(model, order, mc.backend,
                      lambda m: shardc.compile(m, text, mesh=MESH, example_inputs=ex))
        assert not (sm._orig_mod if order == "after" else sm).hooks      # the emitted fx forward
        o = par.make_opt(opt_kind, sm)
        opt = sm.optimizer(o.pop("cls"), **o)
        steps = _steps(world)
        losses, graphs = [], []
        for step in steps:
            with mc.step():
                losses += par.train(sm, opt, [step], rank, world, ACC)
            counts = mc.last
            graphs.append(counters["stats"]["unique_graphs"])
        with torch.no_grad():
            losses.append(par.eval_loss(sm, rank, world))
        state = {k: v.clone() for k, v in sm.full_state_dict().items()}
        out.append((losses, state, *counts, graphs))
    return out


def _plain_counts(make, order, run_step):
    """(compiled, eager) matmuls of the last of 2 steps of `order` without shardc."""
    torch._dynamo.reset()
    mc = MatmulCount()
    model = make()
    m = compiled(model, order, mc.backend, None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        with mc.step():
            run_step(m, opt)
    return mc.last


def _gpt_step(m, opt):
    for xy in _steps(1)[0]:
        x, y = xy[0], xy[1]
        (nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten()) / ACC).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", ["zero3.shard", "paro_iig.shard"])
def test_gpt_compiled_in_every_order_trains_at_parity(name, order):
    plain, plain_eager = _plain_counts(par.make_model, order, _gpt_step)
    assert plain == expected_compiled(par.make_model(), order)      # the counter counts what runs
    results = dist_run(4, _gpt_job, strategy_text(name), order, ("sgd", "adamw"))
    for i, opt_kind in enumerate(("sgd", "adamw")):
        per_rank = [r[i] for r in results]
        par._assert_close([(losses, state) for losses, state, *_ in per_rank],
                          par._reference(ACC, opt_kind, 4))
        for _, _, got, eager, graphs in per_rank:
            assert got == plain, f"{order}: {got} matmuls ran compiled, {plain} without shardc"
            assert eager == plain_eager
            assert graphs[1] == graphs[2], f"{order}: recompiled in a warm step ({graphs})"


def _hooks_gpt_job(rank, world, order):
    """The example GPT on the hooks path (export capture): its forward loops over the blocks
    with the lm_head in the same frame, which dynamo runs eagerly; the root's modules must
    still run compiled (runtime/compile.py, [Note: the root unit on the hooks path])."""
    torch._dynamo.reset()
    torch.manual_seed(123 + rank)
    model = GPT(TINY) if rank else par.make_model()
    mc = MatmulCount()
    ex = (torch.zeros(par.MICRO_B, TINY.block_size, dtype=torch.long),)
    text = strategy_text("zero3.shard")
    if order == "before":
        sm = shardc.compile(torch.compile(model, backend=mc.backend), text, mesh=MESH,
                            example_inputs=ex, capture="export")
    else:                                                   # "module": sm.compile()
        sm = shardc.compile(model, text, mesh=MESH, example_inputs=ex, capture="export")
        sm.compile(backend=mc.backend)
    assert sm.hooks
    o = par.make_opt("sgd", sm)
    opt = sm.optimizer(o.pop("cls"), **o)
    losses = []
    for step in _steps(world):
        with mc.step():
            losses += par.train(sm, opt, [step], rank, world, ACC)
    with torch.no_grad():
        losses.append(par.eval_loss(sm, rank, world))
    return losses, {k: v.clone() for k, v in sm.full_state_dict().items()}, *mc.last


@pytest.mark.parametrize("order", ["before", "module"])
def test_gpt_on_the_hooks_path_runs_its_tied_head_compiled(order):
    results = dist_run(4, _hooks_gpt_job, order)
    par._assert_close([r[:2] for r in results], par._reference(ACC, "sgd", 4))
    want = expected_compiled(par.make_model(), "after")
    for _, _, got, eager in results:
        assert (got, eager) == (want, 0), f"{order}: {got} matmuls compiled, {eager} eager; want {want}, 0"


def _llama_job(rank, world, order):
    torch._dynamo.reset()
    counters.clear()
    model = hf.make_model("llama", seed=0 if rank == 0 else 100 + rank)
    mc = MatmulCount()
    ex = (torch.zeros(hf.B, hf.T, dtype=torch.long),)
    sm = compiled(model, order, mc.backend, lambda m: shardc.compile(m, hf.STRATEGY, example_inputs=ex))
    cls, kw = hf.opt_kwargs("sgd")
    opt = sm.optimizer(cls, **kw)
    losses, graphs = [], []
    for step in hf.data(world):
        with mc.step():
            for x in step:
                x = x.chunk(world)[rank]
                loss = sm(x, labels=x).loss / len(step)
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    state = {k: v.clone() for k, v in sm.full_state_dict().items()}
    return losses, state, *mc.last, graphs


def _llama_step(m, opt):
    for x in hf.data(1)[0]:
        (m(x, labels=x).loss / ACC).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("order", ORDERS)
def test_hf_llama_on_the_hooks_path_compiled_in_every_order(order):
    plain, plain_eager = _plain_counts(lambda: hf.make_model("llama"), order, _llama_step)
    assert plain == expected_compiled(hf.make_model("llama"), order)
    results = dist_run(hf.MESH_WORLD, _llama_job, order)
    model = hf.make_model("llama")
    cls, kw = hf.opt_kwargs("sgd")
    ref = hf.train(model, cls(model.parameters(), **kw), 0, hf.MESH_WORLD, False)
    mean = torch.tensor([r[0] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref), rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        for _, state, *_ in results:
            rel = float((state[name] - p.detach()).norm() / p.detach().norm().clamp_min(1e-12))
            assert rel <= 1e-5, f"{order} {name}: relative error {rel:.3g}"
    for _, _, got, eager, graphs in results:
        assert got == plain, f"{order}: {got} matmuls ran compiled, {plain} without shardc"
        assert eager == plain_eager
        assert graphs[1] == graphs[2], f"{order}: recompiled in a warm step ({graphs})"
