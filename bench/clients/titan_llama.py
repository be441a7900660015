"""torchtitan's Llama 3 `debugmodel` for bench/clients/torchtitan_check.py (bench stage: args -> the
model, its batches, the single-process reference and its floors, the example strategies
quantization off, the sharded model; information only).

Input: the harness's parsed args. Output: the model (torchtitan's init from a seed; fused
QKV, SDPA, fp32), the global batches, `reference`/`references` (one process on the
concatenated batches and the float32 floor), `strategy`/`sharded` (shardc's side) and the
comparison helpers the checks share. torchtitan_check.py documents what each check asserts.
"""
from __future__ import annotations

import dataclasses
import os

from titan_common import make_opt, plain, rel_err, get_world

ROOT = next(p for p in __import__("pathlib").Path(__file__).resolve().parents if (p / "pyproject.toml").exists()).as_posix()
STRATEGIES = os.path.join(ROOT, "examples", "strategies")


def build(args, seed: int):
    """torchtitan's Llama 3 debugmodel (fused QKV, SDPA, fp32) on CPU, torchtitan's init."""
    import torch
    from torchtitan.experiments.graph_trainer.llama3 import model_registry
    spec = model_registry("debugmodel", attn_backend="sdpa")
    spec.model.layers = spec.model.layers[:args.layers]
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = spec.model.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    return model


def vocab() -> int:
    from torchtitan.experiments.graph_trainer.llama3 import model_registry
    return model_registry("debugmodel", attn_backend="sdpa").model.vocab_size


def batches(args, steps: int, offset: int = 0):
    import torch
    g, v = torch.Generator().manual_seed(11), vocab()
    xs = [torch.randint(0, v, (args.global_batch, args.seq + 1), generator=g) for _ in range(offset + steps)]
    return xs[offset:]


def train_micro(model, tok, div: int = 1) -> None:
    import torch.nn.functional as F
    x, y = tok[:, :-1], tok[:, 1:]
    (F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / div).backward()


def train(model, opt, xs, rank: int = 0, world: int = 1) -> None:
    for tok in xs:
        train_micro(model, tok.chunk(world)[rank])
        opt.step()
        opt.zero_grad()


def reference(args, kind: str, steps: int, marks=(), chunks: int = 1):
    """Single process on the concatenated batches: {step: (state_dict, optimizer state by
    parameter name)} at each step in `marks` and at `steps`. With `chunks` > 1 each step's
    gradient is accumulated over that many chunks of the batch (what data parallelism
    computes, summed in another order): its distance to `chunks=1` is the float32 floor."""
    model = build(args, 0)
    opt = make_opt(kind, model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    xs = batches(args, steps)
    for i in range(steps + 1):
        if i in marks or i == steps:
            out[i] = (plain(model.state_dict()),
                      {names[id(p)]: plain(st) for p, st in opt.state.items()})
        if i < steps:
            for c in range(chunks):
                train_micro(model, xs[i].chunk(chunks)[c], chunks)
            opt.step()
            opt.zero_grad()
    return out


def references(args, kind: str, steps: int, marks=(), world: int = 1):
    """The reference, and the floors: params and optimizer-state errors of the same run
    accumulated over `world` chunks, at each mark."""
    ref = reference(args, kind, steps, marks)
    alt = reference(args, kind, steps, marks, chunks=world)
    floor = {i: (rel_err(alt[i][0], ref[i][0])[0], optim_err(alt[i][1], ref[i][1])[0]) for i in ref}
    return ref, floor


def bit_equal(got: dict, want: dict) -> bool:
    import torch
    return list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def optim_err(got_state: dict, want_state: dict) -> tuple[float, bool]:
    """Relative error of every tensor state (moments), and whether every `step` agrees."""
    worst, steps_ok = 0.0, set(got_state) == set(want_state)
    for name, st in want_state.items():
        g = got_state.get(name, {})
        e, _ = rel_err({k: g[k] for k in st if k in g and k != "step"},
                       {k: v for k, v in st.items() if k != "step" and k in g})
        worst = max(worst, e)
        steps_ok &= set(g) == set(st) and float(g.get("step", -1)) == float(st.get("step", -2))
    return worst, steps_ok


def strategy(name: str, mesh: str):
    """An example strategy with quantization off (tests/test_runtime_util.py's `strategy`)."""
    import shardc
    from shardc.dsl.ir import DType
    file = {"hpz": "zeropp"}.get(name, name)
    s = shardc.load_strategy(os.path.join(STRATEGIES, f"{file}.shard"), mesh=mesh)
    p, g = s.params, s.grads
    sec = p.secondary and dataclasses.replace(p.secondary, quant=None)
    p = dataclasses.replace(p, comm=DType.FP32, secondary=sec)
    g = dataclasses.replace(g, comm=DType.FP32)
    return dataclasses.replace(s, scopes=dataclasses.replace(s.scopes, params=p, grads=g), accumulate=1)


def sharded(args, name: str, mesh: str, seed: int):
    import torch
    import shardc
    x = torch.zeros(args.global_batch // get_world(), args.seq, dtype=torch.long)
    return shardc.compile(build(args, seed), strategy(name, mesh), example_inputs=(x,), timeout=1800)


def fmt(c: dict) -> str:
    if "error" in c:
        return c["error"]
    def one(k, v):
        if isinstance(v, float):
            return f"{k} {v:.1f}" if k == "seconds" or k.endswith("_s") else f"{k} {v:.2e}"
        return f"{k} {v}"
    return ", ".join(one(k, v) for k, v in c.items() if k != "ok")


def titan_init(m) -> None:
    """torchtitan's own init of one module: what its `Module.init_states` runs for each module
    after its children (`_init_self_parameters`, `_init_self_buffers`); a plain nn.Module's
    `reset_parameters()`."""
    import torch
    from torchtitan.protocols.module import Module
    if isinstance(m, Module):
        m._init_self_parameters()
        m._init_self_buffers(buffer_device=torch.device("cpu"))
    elif callable(getattr(m, "reset_parameters", None)):
        m.reset_parameters()
