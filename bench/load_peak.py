"""The load's peak per rank (issue 54) — stage: benchmark (information only).

Input: a 124.7M-parameter HF Llama (vocab 32000, hidden 768, 12 layers, 4 KV heads; 476 MiB
in fp32) saved by `save_pretrained` in 6 files with their index. Output, per strategy
(ZeRO-3, hpZ, PaRO-IIG on 4 gloo ranks, mesh node(2) > gpu(2), and FSDP2's DCP load of the
same files, `LOAD_PEAK_ONLY=fsdp2`; torch's own recipe on shardc's ZeRO-3,
`dcp.load(sm.state_dict(), storage_reader=HuggingFaceStorageReader(path))` then
`sm.load_state_dict`, `LOAD_PEAK_ONLY=recipe:zero3`): each rank's RSS growth
from just before `shardc.load_safetensors` to its peak during it (Linux `VmHWM`, reset
before the load), in MiB and as a share of the whole model, beside the rank's shards
(params + hpZ secondary + fp32 master where separate), which compile allocated (zeros)
before the load: the growth is what the load itself costs; and the growth from just
before `shardc.compile` to the peak of compile and load together (the issue's figure:
shards, grads if allocated, the load's copies), the largest rank and the largest of the ranks
that received the plan (rank 0 alone captures: torch.export's first use in a process costs
about 32 MiB of code and caches whatever the model). `LOAD_PEAK_ONLY=zero3` runs one strategy,
`LOAD_PEAK_ONLY=recipe:zero3,fsdp2` those two, in that order.
`LOAD_PEAK_BIG=1` takes bench/bigmodel.py's 836M Llama (TinyLlama's width, 16 layers) on 8
ranks instead (ZeRO-3 over gpu(8), hpZ and PaRO-IIG over node(2) > gpu(4)). Usage:
    python bench/load_peak.py [workdir]
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 2 ** 20
CFG = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
           num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False)
CASES = (("zero3", "node(1) > gpu(4)"), ("zeropp", "node(2) > gpu(2)"), ("paro_iig", "node(2) > gpu(2)"))
WORLD = 4
if os.environ.get("LOAD_PEAK_BIG"):                 # bench/bigmodel.py's 836M model on 8 ranks
    CFG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False)
    CASES = (("zero3", "node(1) > gpu(8)"), ("zeropp", "node(2) > gpu(4)"), ("paro_iig", "node(2) > gpu(4)"))
    WORLD = 8


def _status() -> dict[str, int]:
    from bigmodel import proc_status     # bench/ is on the path (the script's own folder)
    return proc_status()


def _compiled(name, mesh):
    """The meta-built Llama compiled under `name` on `mesh` with buffers only: (sm, its memory
    report, VmRSS before compile, VmHWM after it)."""
    import shardc
    from tests.test_runtime_util import strategy
    from transformers import LlamaConfig, LlamaForCausalLM
    x = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**CFG))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = _status()["VmRSS"]
    sm = shardc.compile(model, strategy(name, mesh), example_inputs=(x,), init=shardc.buffers_only(model._init_weights))
    return sm, sm.memory_report(), rss0, _status()["VmHWM"]


def _rank(rank, world, path, name, mesh):
    import shardc
    sm, rep, rss0, hwm_compile = _compiled(name, mesh)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                        # VmHWM := VmRSS
    before = _status()["VmRSS"]
    shardc.load_safetensors(sm, path)
    hwm_load = _status()["VmHWM"]
    share = rep["params"] + rep["params_secondary"] + rep["optim"]
    return dict(peak=hwm_load - before, startup=max(hwm_compile, hwm_load) - rss0, share=share)


def _recipe(rank, world, path, name, mesh):
    """torch's own recipe on a shardc model (what an FSDP2 user writes): `sd = sm.state_dict();
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(path)); sm.load_state_dict(sd)`; the
    pieces are views of the shards (runtime/state/checkpoint.py [Note: the recipe loads in
    place]). Counted from just before `sm.state_dict()`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    sm, rep, rss0, hwm_compile = _compiled(name, mesh)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status()["VmRSS"]
    sd = sm.state_dict()
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(path))
    sm.load_state_dict(sd)
    hwm_load = _status()["VmHWM"]
    share = rep["params"] + rep["params_secondary"] + rep["optim"]
    return dict(peak=hwm_load - before, startup=max(hwm_compile, hwm_load) - rss0, share=share)


def _fsdp2(rank, world, path):
    """FSDP2's DCP load of the same files: `fully_shard` per decoder layer and the root on a
    mesh of WORLD, `to_empty`, then `dcp.load` of `get_model_state_dict` (DTensor views of the
    sharded parameters) through torch's `HuggingFaceStorageReader`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**CFG))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = _status()["VmRSS"]
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    hwm_shard = _status()["VmHWM"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status()["VmRSS"]
    sd = {k: v for k, v in get_model_state_dict(model).items() if "inv_freq" not in k}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(path))
    hwm_load = _status()["VmHWM"]
    share = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    return dict(peak=hwm_load - before, startup=max(hwm_shard, hwm_load) - rss0, share=share)


def main(workdir: str) -> None:
    from tests.harness import dist_run
    from transformers import LlamaConfig, LlamaForCausalLM
    path = os.path.join(workdir, "hf")
    if not os.path.isdir(path):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**CFG)).save_pretrained(path, max_shard_size="90MB" if WORLD == 4 else "1GB")
    with torch.device("meta"):
        whole = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**CFG)).parameters()) * 4
    print(f"model {whole / 4 / 1e6:.1f}M params, {whole / MIB:.0f} MiB fp32, "
          f"{len([f for f in os.listdir(path) if f.endswith('.safetensors')])} files")
    only = os.environ.get("LOAD_PEAK_ONLY")
    recipe = (("recipe:" + CASES[0][0], CASES[0][1]),)
    for name, mesh in CASES + recipe + (("fsdp2", None),):
        if only is not None and name not in only.split(","):
            continue
        if name == "fsdp2":
            rs = dist_run(WORLD, _fsdp2, path, timeout=1800)
        elif name.startswith("recipe:"):
            rs = dist_run(WORLD, _recipe, path, name.split(":")[1], mesh, timeout=1800)
        else:
            rs = dist_run(WORLD, _rank, path, name, mesh, timeout=1800)
        peak = max(r["peak"] for r in rs)
        start = max(r["startup"] for r in rs)
        others = max(r["startup"] for r in rs[1:])     # ranks that received the plan: no capture
        share = max(r["share"] for r in rs)
        print(f"{name:13s} load peak +{peak / MIB:.0f} MiB/rank = {100 * peak / whole:.0f} % of the model "
              f"(the rank's shards, allocated at compile: {share / MIB:.0f} MiB = {100 * share / whole:.0f} %); "
              f"compile + load from before compile: +{start / MIB:.0f} MiB = {100 * start / whole:.0f} % "
              f"(+{others / MIB:.0f} MiB = {100 * others / whole:.0f} % on the ranks that received the plan)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
