"""Mixed precision across units (units/casts.py, [Note: casts at unit boundaries]): a
root unit and blocks of different `params dtype` (and `grads dtype`), written as the user
does (an `override` block, loaded by the DSL), train on 4 gloo ranks at parity with one
process on the concatenated batch running the same casts — fp32 masters, each unit's
params cast to its dtype for the forward (torch.func.functional_call), each block's
inputs cast to its dtype and its outputs back to the root's. Every unit's inputs arrive in
the same dtypes on both sides (exact), and the final fp32 parameters agree within a few
units in the last place of the narrowest dtype in play (rounding happens per rank on one
side and on the whole batch on the other).

The sweep draws random strategies with a fixed seed: per unit (the top level for the root,
the override for the blocks) the params, grads and optim levels, an hpZ secondary, the
params and grads dtypes, and the strategy's accumulate. Every draw either loads (what
`shardc check` runs) and trains at parity, or is refused in one ShardcError — by the DSL
(located diagnostics) or by `shard_module` on the ranks — and never fails with another
error at run time."""
from __future__ import annotations

import copy
import dataclasses
import os
import random

import pytest
import torch

from tests.harness import dist_run
from tests.test_runtime_util import ROOT, Tiny, batches, loss_fn, make_opt, max_rel_err

pytestmark = pytest.mark.distributed

MESH = "node(2) > gpu(2)"
LEVELS = ((), ("gpu",), ("node",), ("node", "gpu"))
P_DTYPES = ("fp32", "bf16", "fp16")
EPS = {"fp32": 2.0 ** -23, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
ULPS = 8           # a few roundings of the narrowest dtype per step, over 3 steps
TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _draw_scopes(rng, pd, gd):
    """One unit's scopes: optim levels, grads within them, params within those (a draw in
    five ignores the nesting, which the DSL's dependency rule refuses), maybe a secondary."""
    from shardc.dsl.ir import DType, GradsSpec, OptimSpec, ParamsSpec, Secondary
    sub = lambda lv: tuple(l for l in lv if rng.random() < 0.6)          # noqa: E731
    o = rng.choice(LEVELS)
    g, p = (rng.choice(LEVELS), rng.choice(LEVELS)) if rng.random() < 0.2 else (sub(o), None)
    p = sub(g) if p is None else p
    sec = Secondary(sub(p) or p) if p and rng.random() < 0.3 else None
    return (ParamsSpec(p, sec, DType(pd), DType(pd)), GradsSpec(g, DType(gd), DType(gd)), OptimSpec(o))


def _draw(rng, rp, bp):
    """A random strategy text with the root's dtypes at the top level and the blocks' in an
    override, as a user writes it; its (root grads, blocks grads) dtypes and accumulate.
    One params dtype for both gets grads dtypes that differ."""
    import shardc
    from shardc.dsl import unparse
    from shardc.dsl.ir import Override, Scopes
    rg, bg = rng.choice(("fp32", "bf16")), rng.choice(("fp32", "bf16"))
    if rp == bp:
        rg, bg = rng.choice((("fp32", "bf16"), ("bf16", "fp32")))
    s = shardc.load_strategy(f"mesh {MESH}\nparams replicate\n")
    bp_, bg_, bo_ = _draw_scopes(rng, bp, bg)
    ov = Override("blocks.*", params=bp_, grads=bg_, optim=bo_)
    s = dataclasses.replace(s, scopes=Scopes(*_draw_scopes(rng, rp, rg)), overrides=(ov,),
                            accumulate=rng.choice((1, 2)))
    return unparse(s), rg, bg, s.accumulate


def _mixes(refused: list):
    """(text, root params, blocks params, root grads, blocks grads, accumulate): one accepted
    draw for every pair of params dtypes that differ and one of a single params dtype
    (whose grads dtypes may differ per unit); the draws the DSL refuses go to `refused` as
    (text, error)."""
    import shardc
    from shardc.dsl.errors import ShardcError
    rng = random.Random(48)
    out = []
    pairs = [(rp, bp) for rp in P_DTYPES for bp in P_DTYPES if rp != bp] + [("fp32", "fp32")]
    for rp, bp in pairs:
        while True:
            text, rg, bg, acc = _draw(rng, rp, bp)
            try:
                shardc.load_strategy(text, mesh=MESH)
            except ShardcError as e:
                refused.append((text, e))
                continue
            out.append((text, rp, bp, rg, bg, acc))
            break
    return out


def _units(model, s):
    from shardc.lowering import unit_scopes
    from shardc.runtime import UnitSpec
    names = [n for n, _ in model.named_parameters()]
    out = [UnitSpec("<root>", tuple(n for n in names if not n.startswith("blocks.")), unit_scopes(s, "<root>")[0])]
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        out.append(UnitSpec(b, tuple(n for n in names if n.startswith(b + ".")), unit_scopes(s, b, (b,))[0], (b,)))
    return out


def _seen_dtypes(model):
    """Record the dtype of each block's first input, in call order."""
    seen = []
    for b in model.blocks:
        b.register_forward_pre_hook(lambda m, args: seen.append(str(args[0].dtype)))
    return seen


def _reference(model, data, rp, bp, acc):
    """One process, the same casts written out: fp32 params, the forward on their casts
    (the micro-batches' seen dtypes recorded as the ranks run them: `acc` per step)."""
    from torch.func import functional_call
    model = copy.deepcopy(model)
    for b in model.blocks:
        b.register_forward_pre_hook(lambda m, args: tuple(a.to(TORCH[bp]) for a in args))
        b.register_forward_hook(lambda m, args, out: out.to(TORCH[rp]))
    seen = _seen_dtypes(model)
    opt = make_opt("adamw", list(model.parameters()))
    for x, y in data:
        params = {n: p.to(TORCH[bp] if n.startswith("blocks.") else TORCH[rp])
                  for n, p in model.named_parameters()}
        loss_fn(functional_call(model, params, (x,)).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}, seen * acc


def _run(rank, world, mixes):
    import shardc
    from shardc.dsl.errors import ShardcError
    from shardc.runtime import shard_module
    out = []
    for text, rp, bp, rg, bg, acc in mixes:
        s = shardc.load_strategy(text, mesh=MESH)
        data = batches(3, world, acc)
        model = Tiny()
        want, want_seen = _reference(model, data, rp, bp, acc)
        try:
            sm = shard_module(copy.deepcopy(model), s, _units(model, s))
        except ShardcError as e:        # refused at compile, in one sentence
            out.append(((rp, bp, rg, bg, acc), text, str(e)))
            continue
        seen = _seen_dtypes(sm.module)
        opt = make_opt("adamw", sm)
        for x, y in data:
            xs, ys = x.chunk(world)[rank].chunk(acc), y.chunk(world)[rank].chunk(acc)
            for m in range(acc):
                (loss_fn(sm(xs[m]).float(), ys[m]) / acc).backward()
            opt.step()
            opt.zero_grad()
        got = sm.full_state_dict()
        out.append(((rp, bp, rg, bg, acc), text, (max_rel_err(got, want), sorted(seen) == sorted(want_seen) and bool(seen),
                                                  {str(v.dtype) for v in got.values()})))
    return out


def test_mixed_dtypes_train_at_parity():
    refused: list = []
    mixes = _mixes(refused)
    assert len(mixes) == 7 and refused, "the draws cover accepted and refused strategies"
    for text, e in refused:             # one located diagnostic, no traceback
        assert str(e).startswith("error: ") and "Traceback" not in str(e), (text, str(e))
    for rank_res in dist_run(4, _run, mixes):
        for case, text, res in rank_res:
            if isinstance(res, str):
                assert "\n" not in res.strip() and "Traceback" not in res, (case, text, res)
                continue
            err, same_casts, dtypes = res
            narrowest = max(EPS[d] for d in case[:4])
            assert same_casts, (case, text)
            assert dtypes == {"torch.float32"}      # the full state dict is the fp32 master
            assert err < ULPS * narrowest, (case, text, err, ULPS * narrowest)


class _CastsItself(torch.nn.Module):
    """Casts its hidden state to bf16 in its own forward, then meets an fp32 Linear."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.proj = torch.nn.Linear(8, 16)

    def forward(self, x):
        return self.proj(self.emb(x).to(torch.bfloat16))


def test_simulation_checks_dtypes_as_a_real_kernel():
    """Meta kernels accept mm(bf16, fp32); the simulation's check refuses it, naming the
    module, exactly where the CPU run fails; the same model with matching dtypes passes."""
    from shardc.dsl.errors import ShardcError
    from shardc.dtype_check import dtype_check
    x = torch.randint(0, 16, (2, 4))
    with pytest.raises(RuntimeError):
        _CastsItself()(x)                                    # the real kernel
    with torch.device("meta"):
        model = _CastsItself()
    model(x.to("meta"))                                      # meta alone approves it
    with pytest.raises(ShardcError, match=r"in module proj gets tensors of bfloat16, float32"):
        with dtype_check(model):
            model(x.to("meta"))
    model.proj.to(torch.bfloat16)
    with dtype_check(model):
        model(x.to("meta")).float().sum().backward()


MIXED = """mesh node(2) > gpu(2)
params shard over world
grads  shard over world
optim  shard over world
override "transformer.h.*" { params shard over world dtype bf16 }
"""


def test_simulate_runs_a_mixed_gpt(tmp_path):
    """The issue's strategy (fp32 root, bf16 blocks) on examples/gpt.py:tiny: simulate
    runs its step under the dtype check, and its states and ledger equal explain's."""
    import json
    import subprocess
    import sys
    (tmp_path / "mixed.shard").write_text(MIXED)
    proc = subprocess.run([sys.executable, "-m", "shardc.cli", "simulate", str(tmp_path / "mixed.shard"),
                           "--model", os.path.join(ROOT, "examples/gpt.py:tiny"), "--rank", "0",
                           "--micro-batches", "1", "--tokens", "16", "--no-graph", "--no-peak", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rep = json.loads(proc.stdout)[0]
    assert rep["memory"] == rep["explain_memory"] and rep["memory_equal"], rep["memory"]
    assert rep["ledger_equal"]


def test_explain_traces_activations_in_each_units_dtype():
    """explain's activation trace computes each unit in its own params dtype and casts at the
    unit boundaries as the ranks do (units/casts.py): with an fp32 root and bf16 blocks, the
    root saves what the all-fp32 trace saves and each block what the all-bf16 trace saves
    (its input arrives cast to bf16); before, every unit was traced in the top-level dtype."""
    import shardc
    from examples.gpt import tiny
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.analysis.costmodel.flops import trace, unit_dtypes
    from shardc.units import find_units
    with torch.device("meta"):
        model = tiny()
    s = shardc.load_strategy(MIXED)
    units = find_units(model, resolve_bucket(model, s))
    dts = unit_dtypes(s, units, s.scopes.params.dtype.value)
    assert dts == ("fp32",) + ("bf16",) * (len(units) - 1)
    mixed, fp32, bf16 = (trace(model, units, batch=2, seq=16, dtype=d) for d in (dts, "fp32", "bf16"))
    assert mixed.saved == (fp32.saved[0],) + bf16.saved[1:]
    assert mixed.inputs == bf16.inputs and mixed.output == fp32.output
    assert bf16.saved[1] < fp32.saved[1]
