"""`shardc simulate`: ranks of a 1024-rank job run in one process under torch's fake process
group (shardc/simulate.py), with the real compile, runtime and optimizer step.

- LLaMA-65B's width with two blocks under PaRO-IGG on node(128) > gpu(8), as rank 0, rank
  515 (node 64, gpu 3: inside the gpu-major chunk order of its grads and optimizer states)
  and the last rank: the model states and the step's ledger equal the formulas of
  docs/internals.md ("Memory", "Ledger"), worked out here by hand, on every rank.
- ZeRO++ (int8 weights, int4 gradients, an hpZ secondary) on 1000 ranks, where every unit
  needs padding: the same, with the quantized payload formula.
- One flat group of 2.69e9 elements (three blocks of that width in one unit) on 1024 ranks:
  sizes, the last rank's offsets past 2**31 and the ledger's bytes are exact.
- A bf16 step puts bf16 on the wire in every collective, the step's sync and update
  included (they went out in fp32, twice the bytes their ledger rows count).
- A quantized collective runs the same operators whatever the group's size (it once
  decoded one rank's payload at a time: a Python loop over 1024 ranks per collective).
- Bad input is one sentence: a rank outside the world, a mesh that does not divide the
  world, a model factory that cannot build on the meta device.
The simulations run in one subprocess (the default process group is process-wide).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# LLaMA-65B's sizes (examples/llama.py): dim 8192, SwiGLU 22016, vocabulary 32000
DIM, FFN, VOCAB = 8192, 22016, 32000
PHI_ROOT = 2 * VOCAB * DIM + DIM                        # embedding, head, final norm
PHI_BLOCK = 4 * DIM * DIM + 3 * DIM * FFN + 2 * DIM      # q, k, v, o; w1, w2, w3; two norms

DRIVER = r"""
import json, sys
import torch, torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from shardc.cli import main

for argv in json.loads(sys.argv[1]):
    main(argv)
    print("\n#END", flush=True)

# operators one quantized all-gather / reduce-scatter runs, over 8 ranks and over 1024
from torch.testing._internal.distributed.fake_pg import FakeStore
from shardc.dsl.ir import DType, Mesh, Level
from shardc.runtime.eager import collectives as C
from shardc.runtime.transport.mesh import ShardMesh

class Count(TorchDispatchMode):
    n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Count.n += 1
        return func(*args, **(kwargs or {}))

dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=1024)
sm = ShardMesh(Mesh((Level("node", 128), Level("gpu", 8))), "cpu")
counts = {}
for levels in (("gpu",), ("node", "gpu")):
    s, m = sm.factor(levels), 1000
    sm.group(levels)
    Count.n = 0
    with Count():
        C.all_gather(torch.empty(s * m, device="meta"), torch.empty(m, device="meta"), sm, levels,
                     comm=DType.INT8).wait()
        C.reduce_scatter(torch.empty(m, device="meta"), torch.empty(s * m, device="meta"), sm, levels,
                         comm=DType.INT4).wait()
    counts[s] = Count.n
print(json.dumps(counts))
dist.destroy_process_group()
print("#END", flush=True)

# the dtypes a bf16 step puts on the wire: every c10d collective's tensors
import shardc
from shardc.simulate import simulate_rank
from shardc.cli.loader import load_factory
wire = []
for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
    def spy(*a, _f=getattr(dist, name), _n=name, **kw):
        wire.append((_n, str(a[0].dtype)))
        return _f(*a, **kw)
    setattr(dist, name, spy)
simulate_rank(shardc.load_strategy(sys.argv[2]), load_factory(sys.argv[3]), 5, micro_batches=2, seq=8, peak=False)
print(json.dumps(sorted(set(wire))))
"""
BF16 = """strategy bf16_steps
mesh node(2) > gpu(2) > gcd(2)
params shard over gcd dtype bf16
grads  shard over gcd dtype bf16
optim  shard over gpu, gcd
accumulate 2
"""


def _cli(model, strategy, mesh, ranks, mb, world=None, peak=True):
    return ["simulate", os.path.join(ROOT, strategy), "--model", os.path.join(ROOT, model),
            *(["--world", str(world)] if world else []), "--mesh", mesh, "--rank", ranks,
            "--micro-batches", str(mb), "--tokens", "64", "--clip", "--no-graph", "--json",
            *([] if peak else ["--no-peak"])]


WHOLE = """strategy whole
mesh node(*) > gpu(8)
params shard over world
grads  shard over world
optim  shard over world
units type Embedding
accumulate 1
"""
THREE_BLOCKS = f"""import sys
sys.path.insert(0, {os.path.join(ROOT, "examples")!r})
from llama import Llama, LlamaConfig
def three():
    return Llama(LlamaConfig(dim={DIM}, n_layers=3, n_heads=64, ffn_dim={FFN}))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The three simulations' reports and the operator counts, from one subprocess."""
    tmp = tmp_path_factory.mktemp("sim")
    (tmp / "whole.shard").write_text(WHOLE)
    (tmp / "three.py").write_text(THREE_BLOCKS)
    argvs = [_cli("examples/llama.py:llama_65b_2l", "examples/strategies/paro_igg.shard", "node(128) > gpu(8)",
                  "0,515,last", 4),
             _cli("examples/llama.py:llama_65b_2l", "examples/strategies/zeropp.shard", "node(*) > gpu(8)",
                  "last", 2, world=1000, peak=False),
             _cli(f"{tmp / 'three.py'}:three", str(tmp / "whole.shard"), "node(128) > gpu(8)", "last", 1, peak=False)]
    (tmp / "bf16.shard").write_text(BF16)
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs), str(tmp / "bf16.shard"),
                           os.path.join(ROOT, "examples/llama.py:llama_tiny")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    *docs, counts, wire = proc.stdout.split("#END")
    return [json.loads(d) for d in docs], json.loads(counts), json.loads(wire.strip().splitlines()[-1])


def _rows(ledger):
    return sorted((r["phase"], r["op"], tuple(r["levels"]), r["bytes"], r["count"]) for r in ledger)


def test_paro_igg_llama65b_width_on_1024_ranks(runs):
    reports = runs[0][0]
    assert [r["rank"] for r in reports] == [0, 515, 1023]
    assert reports[1]["coords"] == {"node": 64, "gpu": 3}
    # PaRO-IGG, fp32, AdamW: params over gpu (8), grads and optim over the world (1024):
    # padding to lcm(8, 1024, 1024) = 1024 (both sizes divide: no padding here)
    n_root, n_block = (math.ceil(phi / 1024) * 1024 for phi in (PHI_ROOT, PHI_BLOCK))
    n = n_root + 2 * n_block
    memory = {"params": 4 * n // 8, "params_secondary": 0, "grads": 4 * n // 1024,
              "optim": 8 * n // 1024,                   # m and v; the fp32 master is the params shard
              "total": 4 * n // 8 + 12 * n // 1024}
    m = 4
    ledger = [("forward", "all_gather", ("gpu",), 4 * n_root, m), ("forward", "all_gather", ("gpu",), 4 * n_block, 2 * m),
              ("backward", "all_gather", ("gpu",), 4 * n_block, 2 * m),          # the root stays gathered
              ("backward", "reduce_scatter", ("node", "gpu"), 4 * n_root, m),
              ("backward", "reduce_scatter", ("node", "gpu"), 4 * n_block, 2 * m),
              ("update", "all_gather", ("node",), 4 * n_root // 8, 1),          # OS minus P, N/s_P elements
              ("update", "all_gather", ("node",), 4 * n_block // 8, 2),
              ("update", "all_reduce", ("node", "gpu"), 4, 1)]                 # clip_grad_norm_
    for r in reports:
        assert r["memory"] == memory, r["rank"]
        assert _rows(r["ledger"]) == sorted(ledger), r["rank"]
        assert r["memory_equal"] and r["ledger_equal"], r["rank"]
        assert r["peak"]["measured"] >= memory["total"]
        # the peak phase by phase: each micro-batch's forward, its backward, the step; the
        # step's peak is the largest phase's, and every phase holds at least the states
        phases = r["peak"]["phases"]
        assert list(phases) == ["forward", "backward", "step"], phases
        assert r["peak"]["measured"] == max(phases.values()) and r["peak"]["phase"] == max(phases, key=phases.get)
        assert min(phases.values()) >= memory["total"]


def test_zeropp_padded_on_1000_ranks(runs):
    (r,) = runs[0][1]
    assert r["rank"] == 999 and r["world"] == 1000 and r["mesh"] == "node(125) > gpu(8)"
    # ZeRO++: params, grads, optim over the world (1000), secondary over gpu (8):
    # padding to lcm(1000, 1000, 1000, 8) = 1000; int8 weights, int4 gradients
    n_root, n_block = (math.ceil(phi / 1000) * 1000 for phi in (PHI_ROOT, PHI_BLOCK))
    assert (n_root, n_block) != (PHI_ROOT, PHI_BLOCK)
    n = n_root + 2 * n_block

    def q(n_, s, bits):                     # quantized payload of n_ elements over s ranks
        return s * (math.ceil(n_ // s * bits / 8) + math.ceil(n_ // s / 256) * 4)
    memory = {"params": 4 * n // 1000, "params_secondary": 4 * 2 * n_block // 8,   # no root secondary
              "grads": 4 * n // 1000, "optim": 8 * n // 1000}
    memory["total"] = sum(memory.values())
    m = 2
    ledger = [("forward", "all_gather", ("node", "gpu"), q(n_root, 1000, 8), m),
              ("forward", "all_gather", ("node", "gpu"), q(n_block, 1000, 8), 2 * m),
              ("backward", "all_gather", ("gpu",), 4 * n_block, 2 * m),         # the fp32 secondary
              ("backward", "all_to_all", ("node", "gpu"), q(n_root, 1000, 4), m),
              ("backward", "all_to_all", ("node", "gpu"), q(n_block, 1000, 4), 2 * m),
              ("update", "all_reduce", ("node", "gpu"), 4, 1)]
    assert r["memory"] == memory
    assert _rows(r["ledger"]) == sorted(ledger)
    assert r["memory_equal"] and r["ledger_equal"]


def test_one_flat_group_past_two_to_the_31_elements(runs):
    # three blocks of LLaMA-65B's width in the root unit (`units type Embedding`: the
    # embedding is the one other unit): a flat group of 2.69e9 elements, the last rank's
    # chunk starting past 2**31
    (r,) = runs[0][2]
    n_root, n_emb = (math.ceil(phi / 1024) * 1024 for phi in (3 * PHI_BLOCK + DIM + VOCAB * DIM, VOCAB * DIM))
    assert n_root > 2**31 and 1023 * (n_root // 1024) > 2**31
    n = n_root + n_emb
    assert r["memory"] == {"params": 4 * n // 1024, "params_secondary": 0, "grads": 4 * n // 1024,
                           "optim": 8 * n // 1024, "total": 16 * n // 1024}
    ledger = [("forward", "all_gather", ("node", "gpu"), 4 * n_root, 1),
              ("forward", "all_gather", ("node", "gpu"), 4 * n_emb, 1),
              ("backward", "all_gather", ("node", "gpu"), 4 * n_emb, 1),      # the root stays gathered
              ("backward", "reduce_scatter", ("node", "gpu"), 4 * n_root, 1),
              ("backward", "reduce_scatter", ("node", "gpu"), 4 * n_emb, 1),
              ("update", "all_reduce", ("node", "gpu"), 4, 1)]
    assert _rows(r["ledger"]) == sorted(ledger)
    assert r["memory_equal"] and r["ledger_equal"]


def test_quantized_collectives_run_the_same_operators_on_8_and_1024_ranks(runs):
    counts = runs[1]
    assert set(counts) == {"8", "1024"}
    assert counts["8"] == counts["1024"] > 0


def test_a_bf16_step_sends_bf16(runs):
    # params and grads in bf16 over gcd, optimizer states over gpu, gcd: the backward's
    # gathers and reduce-scatters, the sync's reduce-scatter (over gpu) and all-reduce (over
    # node) of the grad shard, and the update all-gather (over gpu) all carry bf16, the 2 bytes per element the ledger
    # counts (docs/internals.md "Ledger"); the sync and update once went out in fp32
    wire = {tuple(w) for w in runs[2]}
    assert {op for op, _ in wire} == {"all_gather_single", "reduce_scatter_single", "all_reduce"}
    assert {dt for _, dt in wire} == {"torch.bfloat16"}, wire


def test_codec_rows_are_the_one_row_codec():
    import torch

    from shardc.dsl.ir import DType
    from shardc.runtime.transport import quant
    g = torch.Generator().manual_seed(0)
    for m in (1, 255, 256, 301):
        x = torch.randn(5, m, generator=g) * torch.tensor([0.0, 1.0, 1e-3, 7.0, 1e4])[:, None]
        for dt in (DType.INT8, DType.INT4):
            rows = quant.quantize_rows(x, dt)
            assert torch.equal(rows, torch.stack([quant.quantize(r, dt) for r in x]))
            assert torch.equal(quant.dequantize_rows(rows, m, dt),
                               torch.stack([quant.dequantize(p, m, dt) for p in rows]))
    # batches of rows: every row once, at most ROWS_AT_ONCE elements a call (a single row may
    # be more), as few calls as that allows
    for rows, m in ((1024, 1000), (1024, 790_544), (8, 2**25), (3, 1)):
        batches = quant.row_batches(rows, m)
        assert [lo for lo, _ in batches] + [rows] == [0] + [hi for _, hi in batches]
        assert all((hi - lo) * m <= quant.ROWS_AT_ONCE or hi - lo == 1 for lo, hi in batches)
        assert len(batches) == math.ceil(rows / max(1, quant.ROWS_AT_ONCE // m))
        # on meta (a simulated rank) only the first, the largest: its temporaries are the
        # collective's codec peak, with one call whatever the group ([Note: codec batches on meta])
        assert quant.row_batches(rows, m, "meta") == batches[:1]
        assert quant.row_batches(rows, m, "cpu") == batches


def _error(capsys, argv):
    from shardc.cli import main
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    return err


def test_bad_input_is_one_sentence(capsys, tmp_path):
    s = os.path.join(ROOT, "examples/strategies/zero3.shard")
    llama = os.path.join(ROOT, "examples/llama.py:llama_65b_2l")
    err = _error(capsys, ["simulate", s, "--model", llama, "--mesh", "node(128) > gpu(8)", "--rank", "1024"])
    assert "rank 1024 is outside the world" in err and "0..1023" in err
    err = _error(capsys, ["simulate", s, "--model", llama, "--world", "1000", "--mesh", "node(*) > gpu(7)"])
    assert "not divisible by 7" in err
    (tmp_path / "m.py").write_text("import torch\nfrom torch import nn\n"
                                   "def on_cpu():\n    return nn.Linear(4, 4, device='cpu')\n"
                                   "def reads():\n    m = nn.Linear(4, 4)\n    return m if m.weight.sum() else m\n")
    for factory, why in (("on_cpu", "'weight' was created on cpu"), ("reads", "it raised RuntimeError")):
        err = _error(capsys, ["simulate", s, "--model", f"{tmp_path / 'm.py'}:{factory}", "--mesh", "node(2) > gpu(4)"])
        assert "cannot build the model on the meta device" in err and why in err
