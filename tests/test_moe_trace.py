"""Mixture-of-experts models in the graph trace: the experts' grouped matmul
(`aten._grouped_mm`, what Hugging Face's Mixtral runs) counts the active experts'
FLOPs, in bf16 and fp32 alike ([Note: what the trace counts] in
analysis/costmodel/flops.py). Expected FLOPs come from per-group `torch.mm` loops
counted by torch's own counter, and from the model's shapes written out by hand.
"""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shardc import load_strategy
from shardc.analysis.costmodel.bucketing import resolve_bucket
from shardc.analysis.costmodel.flops import grouped_mm_flop, trace
from shardc.cli import main as cli_main
from shardc.cli.loader import build_model
from shardc.units import find_units

H, FFN, LAYERS, HEADS, KV, VOCAB, EXPERTS, TOP_K = 64, 96, 2, 4, 2, 128, 4, 2
FACTORY = f"""
import torch
from transformers import MixtralConfig, MixtralForCausalLM

def mixtral():
    cfg = MixtralConfig(vocab_size={VOCAB}, hidden_size={H}, intermediate_size={FFN}, num_hidden_layers={LAYERS},
                        num_attention_heads={HEADS}, num_key_value_heads={KV}, num_local_experts={EXPERTS},
                        num_experts_per_tok={TOP_K}, max_position_embeddings=64)
    with torch.device("meta"):
        return MixtralForCausalLM(cfg)
"""


def counted(fn, grouped=True):
    mapping = {torch.ops.aten._grouped_mm: grouped_mm_flop} if grouped else {}
    with FlopCounterMode(display=False, custom_mapping=mapping) as c:
        out = fn()
    return c.get_total_flops(), out


@pytest.mark.parametrize("case", ["rows", "contraction", "columns", "batched"])
def test_grouped_mm_counts_what_a_loop_of_matmuls_counts(case):
    g = torch.Generator().manual_seed(0)
    sizes = [3, 0, 5, 8]                     # one group empty: the router sent it nothing
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    bounds = list(zip([0] + offs.tolist()[:-1], offs.tolist()))
    if case == "rows":                       # (rows, k) × (G, k, n): the forward of the experts
        a, b = torch.randn(16, 8, generator=g), torch.randn(4, 8, 8, generator=g)
        loop = lambda: torch.cat([a[s:e] @ b[i] for i, (s, e) in enumerate(bounds)])
    elif case == "contraction":              # (m, rows) × (rows, n) -> (G, m, n): the experts' weight gradients
        a, b = torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)
        loop = lambda: torch.stack([a[:, s:e] @ b[s:e] for s, e in bounds])
    elif case == "columns":                  # (G, m, k) × (k, cols) -> (m, cols)
        a, b = torch.randn(4, 8, 8, generator=g), torch.randn(8, 16, generator=g)
        loop = lambda: torch.cat([a[i] @ b[:, s:e] for i, (s, e) in enumerate(bounds)], dim=1)
    else:                                    # (G, m, k) × (G, k, n): a batch of matmuls
        a, b = torch.randn(4, 8, 8, generator=g), torch.randn(4, 8, 8, generator=g)
        offs, loop = None, lambda: torch.stack([a[i] @ b[i] for i in range(4)])
    got, out = counted(lambda: torch._grouped_mm(a, b, offs=offs))
    want, ref = counted(loop, grouped=False)
    torch.testing.assert_close(out, ref)    # the case is the operation its loop spells out
    assert got == want > 0


def model_flops_by_hand(tokens: int, seq: int):
    """Forward FLOPs of the tiny Mixtral: every matmul weight a token meets (top-k experts of
    EXPERTS, the router, attention projections with grouped KV heads, the LM head), plus
    attention's 4·b·s²·(h·d) per layer."""
    d = H // HEADS
    attn_proj = H * H + 2 * H * KV * d + H * H
    experts = TOP_K * (H * 2 * FFN + FFN * H)
    per_token = LAYERS * (attn_proj + H * EXPERTS + experts) + H * VOCAB
    matmul = 2 * tokens * per_token
    attention = LAYERS * 4 * (tokens // seq) * seq * seq * H
    return matmul, attention


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "moe.py"
    path.write_text(FACTORY)
    spec = f"{path}:mixtral"
    return build_model(spec, device="meta"), spec          # the loader explain and plan use


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_trace_counts_the_active_experts(model, dtype):
    m, _ = model
    units = find_units(m, resolve_bucket(m, load_strategy("strategy a\nmesh gpu(2)\n")))
    g = trace(m, units, batch=2, seq=16, dtype=dtype)
    matmul, attention = model_flops_by_hand(32, 16)
    assert g.forward_flops == matmul + attention
    assert g.backward_flops == 2 * matmul + 2.5 * attention     # top-k of EXPERTS, not every expert
    assert sum(g.saved[1:]) > 0 and len(g.saved) == len(units)


def test_fp32_saves_more_than_bf16(model):
    m, _ = model
    units = find_units(m, resolve_bucket(m, load_strategy("strategy a\nmesh gpu(2)\n")))
    bf16, fp32 = (trace(m, units, batch=1, seq=16, dtype=dt) for dt in ("bf16", "fp32"))
    assert bf16.forward_flops == fp32.forward_flops
    assert bf16.saved[1] < fp32.saved[1] <= 2 * bf16.saved[1]


def test_explain_traces_an_fp32_moe(model, capsys):
    _, spec = model
    assert cli_main(["explain", "examples/strategies/zero3.shard", "--model", spec, "--world", "4",
                     "--mesh", "node(2) > gpu(2)", "--tokens", "32", "--seq", "16"]) == 0
    out, err = capsys.readouterr()
    assert "cannot trace" not in err
    assert "FLOPs counted on the traced graph" in out
    assert "activations 0 B" not in out.replace("\n", " ")
