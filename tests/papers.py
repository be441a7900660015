"""Settings shared by the checks against the papers (test_paper_validation.py: PaRO and
Lins; test_paper_zero_topo.py: ZeRO-topo): strategy text built as a user writes it, and
the DeepSpeed baselines' unit, collective and bucket lines."""
from __future__ import annotations

# The DeepSpeed baselines as DeepSpeed runs them: one all-gather / reduce-scatter per
# submodule with parameters (no fusing across submodules: `bucket 0`), over NCCL's flat
# ring (no hierarchical collectives).
DEEPSPEED = "units type Linear, RMSNorm, Embedding\ncollectives ring\nbucket 0\n"


def strategy(mesh: str, p=(), g=(), o=(), extra="", tail=""):
    """bf16 params and grads sharded over the levels `p`, `g`, optimizer states over `o`
    (replicated where empty); `extra` follows the params scope, `tail` adds lines."""
    from shardc import load_strategy
    sc = lambda lv: f"shard over {', '.join(lv)}" if lv else "replicate"
    return load_strategy(f"strategy s\nmesh {mesh}\nparams {sc(p)}{extra} dtype bf16\n"
                         f"grads {sc(g)} dtype bf16\noptim {sc(o)}\naccumulate 1\n{tail}")
