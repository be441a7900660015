"""Quantized strategies (ZeRO++ qwZ/qgZ/hpZ, ZeRO-topo's int8 secondary and int4 grads)
run and train: the loss falls, the parameters stay close to the unquantized single-process
reference, and the ledger carries the quantized payload sizes of internals.md:
s·(ceil((N/s)·bits/8) + ceil((N/s)/256)·4)."""
from __future__ import annotations

import copy
from math import ceil

import pytest
import torch

from tests.harness import dist_run
from tests.test_runtime_util import (Tiny, batches, loss_fn, make_opt, reference, strategy,
                                     units_for)

pytestmark = pytest.mark.distributed
STEPS = 8


def _train(rank, world, name, mesh, acc):
    from shardc.runtime import shard_module
    model = Tiny()
    data = batches(1, world, acc) * STEPS       # one batch, learned step after step
    init = {k: v.clone() for k, v in model.state_dict().items()}
    want, _ = reference(model, data, "adamw")
    s = strategy(name, mesh, accumulate=acc, quant=True)
    sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
    opt = make_opt("adamw", sm)
    x0, y0 = data[0]
    with torch.no_grad():
        first = float(loss_fn(sm(x0), y0))
    losses = []
    for step, (x, y) in enumerate(data):
        if step == STEPS - 1:
            sm.reset_comm_ledger()
        xs, ys = x.chunk(world)[rank].chunk(acc), y.chunk(world)[rank].chunk(acc)
        total = 0.0
        for m in range(acc):
            loss = loss_fn(sm(xs[m]), ys[m]) / acc
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        opt.step()
        opt.zero_grad()
    got = sm.full_state_dict()
    num = sum(float((got[k] - want[k]).pow(2).sum()) for k in want)
    den = sum(float((want[k] - init[k]).pow(2).sum()) for k in want)
    with torch.no_grad():
        final = float(loss_fn(sm(x0), y0))
    ledger = sorted((r.phase, r.op, r.levels, r.bytes, r.count) for r in sm.comm_ledger())
    return (first, final), (num / den) ** 0.5, ledger


def q(n, s, bits):
    """internals.md quantized payload of a collective over s ranks, logical numel n."""
    return s * (ceil((n // s) * bits / 8) + ceil((n // s) / 256) * 4)


def _check_training(res):
    for (first, final), rel, _ in res:
        assert final < 0.9 * first, (first, final)
        assert rel < 0.25, rel          # within a quarter of the distance travelled


def test_zeropp_quantized_trains():
    res = dist_run(4, _train, "zeropp", "node(2) > gpu(2)", 2)
    _check_training(res)
    # N: root 78 -> 80, blocks 109 -> 112 (L = 4); the last step (accumulate 2) and the
    # final eval forward
    want = sorted([
        ("forward", "all_gather", ("node", "gpu"), q(80, 4, 8), 3),
        ("forward", "all_gather", ("node", "gpu"), q(112, 4, 8), 9),
        ("backward", "all_gather", ("gpu",), 112 * 4, 6),          # hpZ secondary, unquantized
        ("backward", "all_to_all", ("node", "gpu"), q(80, 4, 4), 2),
        ("backward", "all_to_all", ("node", "gpu"), q(112, 4, 4), 6),
    ])
    assert res[0][2] == want


def test_zero_topo_quantized_trains():
    res = dist_run(8, _train, "zero_topo", "node(2) > gpu(2) > gcd(2)", 2)
    _check_training(res)
    # L = lcm(2, 4, 8, 4) = 8: N = 80, 112; secondary int8 over gpu,gcd (s_Q = 4)
    want = sorted([
        ("forward", "all_gather", ("gcd",), q(80, 2, 8), 3),      # params gathered in int8 over s = 2
        ("forward", "all_gather", ("gcd",), q(112, 2, 8), 9),
        ("backward", "all_gather", ("gpu", "gcd"), q(112, 4, 8), 6),
        ("backward", "all_to_all", ("gpu", "gcd"), q(80, 4, 4), 2),
        ("backward", "all_to_all", ("gpu", "gcd"), q(112, 4, 4), 6),
        ("sync", "reduce_scatter", ("node",), 80 // 4 * 4, 1),
        ("sync", "reduce_scatter", ("node",), 112 // 4 * 4, 3),
        ("update", "all_gather", ("node", "gpu"), 80 // 2 * 4, 1),
        ("update", "all_gather", ("node", "gpu"), 112 // 2 * 4, 3),
    ])
    assert res[0][2] == want


@pytest.mark.parametrize("bits", [8, 4])
def test_the_codec_in_place_is_the_formula(bits):
    # runtime/transport/quant.py [Note: the codec's working copies]: whole fp32 blocks are
    # read in place (the input is left as it was), an fp32 output is decoded into directly,
    # a bf16 one scaled in fp32 and cast once; each equals the plain blockwise formula
    from shardc.dsl.ir import DType
    from shardc.runtime.transport import quant
    dt = DType.INT8 if bits == 8 else DType.INT4
    qmax = (1 << (bits - 1)) - 1
    torch.manual_seed(0)
    for m in (512, 301):                                   # whole blocks; a short last block, odd
        x = torch.randn(3, m) * torch.tensor([[1.0], [10.0], [0.0]])
        before = x.clone()
        pay = quant.quantize_rows(x, dt)
        assert torch.equal(x, before)
        blocks = [x[:, i:i + 256] for i in range(0, m, 256)]
        scales = [b.abs().amax(dim=1, keepdim=True) / qmax for b in blocks]
        want = torch.cat([torch.round(b / s.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-qmax, qmax) * s
                          for b, s in zip(blocks, scales)], dim=1)
        assert torch.equal(quant.dequantize_rows(pay, m, dt), want)
        out = torch.full((3, m), float("nan"))
        quant.dequantize_rows(pay, m, dt, out=out)
        assert torch.equal(out, want)
        half = torch.empty(3, m, dtype=torch.bfloat16)
        quant.dequantize_rows(pay, m, dt, out=half)
        assert torch.equal(half, want.to(torch.bfloat16))
