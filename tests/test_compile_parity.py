"""End to end: the example GPT compiled by shardc on N gloo ranks equals one process.

Parity: W ranks, each on its slice of every micro-batch, with
`accumulate` micro-batches per step, equal one process on the concatenated batch
(loss/accumulate summed over micro-batches) to float32 rounding (rel 1e-5), after
several optimizer steps, for AdamW and SGD with momentum. Both routes are checked:
`shardc.compile(...)` in memory, and a module emitted by codegen imported from a file
and applied with its `shard_model`. Compiling a module that is already sharded is one
sentence.
"""
import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

import shardc
from examples.gpt import TINY, GPT
from shardc.compiler.api import compile_source
from tests.harness import dist_run

pytestmark = pytest.mark.distributed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRAT = os.path.join(ROOT, "examples", "strategies")
STEPS, MICRO_B = 3, 2           # optimizer steps; sequences per rank per micro-batch


def make_model():
    torch.manual_seed(0)
    return GPT(TINY)


def batches(world: int, accumulate: int):
    """Every step's micro-batches of the whole world: int64[world*MICRO_B, T] (x, y)."""
    g = torch.Generator().manual_seed(1)
    T = TINY.block_size
    return [[torch.randint(0, TINY.vocab_size, (2, world * MICRO_B, T), generator=g) for _ in range(accumulate)]
            for _ in range(STEPS)]


def make_opt(kind, params_or_model):
    if kind == "adamw":
        return dict(cls=torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    return dict(cls=torch.optim.SGD, lr=0.1, momentum=0.9)


def train(model, opt, steps, rank, world, accumulate, clip=None):
    losses = []
    for step in steps:
        total = 0.0
        for xy in step:
            x, y = xy[0], xy[1]
            if world:
                x, y = x.chunk(world)[rank], y.chunk(world)[rank]
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / accumulate
            loss.backward()
            total += loss.item()
        if clip is not None:
            model.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _ranks_job(rank, world, strategy_text, mesh, combos, emitted_path):
    """Train once per (route, optimizer) combo on this rank; losses and full params of each."""
    out = []
    for route, opt_kind in combos:
        torch.manual_seed(123 + rank)          # different init per rank: rank 0's must win
        model = GPT(TINY) if rank else make_model()
        strategy = shardc.load_strategy(strategy_text, mesh=mesh)
        if route == "compile":
            sm = shardc.compile(model, strategy, capture="fx")
        else:
            import importlib.util
            spec = importlib.util.spec_from_file_location(f"emitted_{rank}", emitted_path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            sm = mod.shard_model(model)
        o = make_opt(opt_kind, sm)
        opt = sm.optimizer(o.pop("cls"), **o)
        losses = train(sm, opt, batches(world, strategy.accumulate), rank, world, strategy.accumulate)
        with torch.no_grad():             # an eval (no-grad) forward: its loss is compared too
            losses.append(eval_loss(sm, rank, world))
        out.append((losses, {k: v.clone() for k, v in sm.full_state_dict().items()}))
    return out


def eval_loss(model, rank, world, split=True):
    x, y = torch.randint(0, TINY.vocab_size, (2, world * MICRO_B, TINY.block_size),
                         generator=torch.Generator().manual_seed(2))
    if split:
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()


def _reference(accumulate, opt_kind, world):
    model = make_model()
    o = make_opt(opt_kind, model)
    opt = o.pop("cls")(model.parameters(), **o)
    losses = train(model, opt, batches(world, accumulate), 0, 0, accumulate)
    with torch.no_grad():
        losses.append(eval_loss(model, 0, world, split=False))
    return losses, dict(model.named_parameters())


def _assert_close(results, ref):
    """Mean of the ranks' local losses = the reference loss; every rank's full params = reference."""
    ref_losses, ref_params = ref
    mean = torch.tensor([r[0] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for _, sd in results:
        assert set(ref_params) <= set(sd)
        for name, p in ref_params.items():
            # rel 1e-5 in norm per tensor: Adam turns rounding noise in a near-zero gradient
            # element into a visible step, so single elements may differ by ~1e-5 of the scale
            p = p.detach()
            rel = float((sd[name] - p).norm() / p.norm().clamp_min(1e-12))
            assert rel <= 1e-5, f"{name}: relative error {rel:.3g}"


def _text(name, exact=True):
    """The shipped strategy; `exact` drops quantization (int8/int4 cannot match to 1e-5)."""
    with open(os.path.join(STRAT, name)) as f:
        text = f.read()
    if exact:
        text = text.replace(" comm int4", "").replace(" comm int8", "").replace("gcd int8", "gcd")
    return text


CASES = [  # (strategy file, mesh override, world)
    ("zero3.shard", "node(2) > gpu(2)", 4),
    ("paro_iig.shard", "node(2) > gpu(2)", 4),
    ("zero_topo.shard", "node(2) > gpu(2) > gcd(2)", 8),
]
COMBOS = (("compile", "adamw"), ("compile", "sgd"), ("emitted", "adamw"), ("emitted", "sgd"))


@pytest.mark.parametrize("name,mesh,world", CASES, ids=[c[0].split(".")[0] for c in CASES])
def test_compile_and_emitted_match_reference(name, mesh, world, tmp_path):
    text = _text(name)
    strategy = shardc.load_strategy(text, mesh=mesh)
    assert not strategy.params.comm.quantized and not strategy.grads.comm.quantized
    source, _ = compile_source(make_model(), strategy, capture="fx")
    emitted = tmp_path / f"emitted_{name.split('.')[0]}.py"
    emitted.write_text(source)
    results = dist_run(world, _ranks_job, text, mesh, COMBOS, str(emitted))
    for i, (_, opt_kind) in enumerate(COMBOS):
        _assert_close([r[i] for r in results], _reference(strategy.accumulate, opt_kind, world))


def test_quantized_zero_topo_trains_close_to_reference():
    """int8 secondary + int4 grads (the shipped zero_topo): losses within 1% of the reference."""
    text, mesh = _text("zero_topo.shard", exact=False), "node(2) > gpu(2) > gcd(2)"
    strategy = shardc.load_strategy(text, mesh=mesh)
    assert strategy.grads.comm.quantized
    results = dist_run(8, _ranks_job, text, mesh, (("compile", "adamw"),), None)
    ref_losses, _ = _reference(strategy.accumulate, "adamw", 8)
    mean = torch.tensor([r[0][0] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref_losses), rtol=1e-2, atol=0)


BUCKET = """mesh node(2) > gpu(2)
params shard over world
grads  shard over world
optim  shard over world
accumulate 2
bucket 120KB
"""


def _bucket_job(rank, world):
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(TINY, n_layer=3))
    sm = shardc.compile(model, BUCKET, capture="fx")
    assert [u.name for u in sm.plan.units] == ["<root>", "transformer.h.0..1", "transformer.h.2"]
    assert sm.source.count("rt.run_unit(1, ") == 2 and sm.source.count("rt.wait_gather(1)") == 1
    opt = sm.optimizer(torch.optim.SGD, lr=0.1, momentum=0.9)
    losses = train(sm, opt, batches(world, 2)[:2], rank, world, 2)
    with torch.no_grad():
        losses.append(eval_loss(sm, rank, world))
    fwd = sorted((r.bytes, r.count) for r in sm.comm_ledger() if r.phase == "forward" and r.op == "all_gather")
    return losses, fwd


def test_bucketed_unit_is_gathered_once_per_forward():
    results = dist_run(4, _bucket_job)
    torch.manual_seed(0)
    model = GPT(dataclasses.replace(TINY, n_layer=3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = train(model, opt, batches(4, 2)[:2], 0, 0, 2)
    with torch.no_grad():
        ref.append(eval_loss(model, 0, 4, split=False))
    mean = torch.tensor([r[0] for r in results]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref), rtol=1e-5, atol=1e-6)
    # numels: root = wte 64*32 + wpe 16*32 + ln_f 2*32 = 2624; block = c_attn 32*96 +
    # c_proj 32*32+32 + 2 LayerNorms 4*32 + c_fc 32*128+128 + c_proj 128*32+32 = 12608.
    # All divisible by lcm(4,4,4) = 4 (no padding); fp32 payload = 4 bytes per element;
    # 2 steps x 2 micro-batches + 1 eval = 5 forwards, one gather per unit per forward.
    expected = sorted([(2624 * 4, 5), (2 * 12608 * 4, 5), (12608 * 4, 5)])
    for _, fwd in results:
        assert fwd == expected


def _twice_job(rank, world):
    from shardc.api import ALREADY_SHARDED
    torch.manual_seed(0)
    model = GPT(TINY)
    sm = shardc.compile(model, os.path.join(STRAT, "zero3.shard"), capture="fx", mesh="gpu(4)")
    out = {}
    for label, again in (("sharded", sm), ("wrapped model", model), ("block", model.transformer.h[0]),
                         ("torch.compile", torch.compile(sm)), ("container", torch.nn.Sequential(sm))):
        try:
            shardc.compile(again, os.path.join(STRAT, "zero3.shard"), capture="fx", mesh="gpu(4)")
            out[label] = "compiled"
        except shardc.ShardcError as e:
            out[label] = str(e)
    return out, ALREADY_SHARDED


def test_compiling_a_sharded_module_again_is_one_sentence():
    # shardc.compile on a ShardedModule, the model it wraps, a block of it, its torch.compile
    # wrapper or a module holding it: "already sharded", not 600 characters of fx internals
    # (nor, for the wrapped model, a silent second sharding of meta placeholders).
    for out, want in dist_run(4, _twice_job):
        assert "already sharded" in want and "\n" not in want
        assert out == dict.fromkeys(out, want) and len(out) == 5, out
