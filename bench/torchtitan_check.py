"""torchtitan's Llama 3 under shardc, end to end (information; issue 36; torchtitan is no test dependency).

    python -m torch.distributed.run --nproc-per-node 8 bench/torchtitan_check.py --check parity
    python -m torch.distributed.run --nproc-per-node 8 bench/torchtitan_check.py --check full
    python -m torch.distributed.run --nproc-per-node 8 bench/torchtitan_check.py --check dcp-save   --dir DIR
    python -m torch.distributed.run --nproc-per-node 4 bench/torchtitan_check.py --check dcp-resume --dir DIR
    python -m torch.distributed.run --nproc-per-node 8 bench/torchtitan_check.py --check fsdp2      --dir DIR
    python bench/torchtitan_check.py --check torch-save --dir DIR        # one process, after dcp-save / fsdp2

Stage: torchrun ranks (gloo, CPU) -> one line per check on rank 0 (and `--json OUT`). The
model is torchtitan's Llama 3 `debugmodel` (graph_trainer's model registry, SDPA, fp32)
with its fused QKV projection: one `wqkv` parameter per layer that the model's own
state-dict post hook saves as `wq`, `wk`, `wv` and a load pre-hook fuses back, so every
model state dict below has wq/wk/wv keys while the parameters (and the optimizer state
keys) are wqkv. `--layers N` keeps the first N layers (the debug model has 6). Every rank
builds the reference itself: one process trained on the concatenated batch (global batch
`--global-batch` sequences of `--seq` tokens, the same global batches whatever the world
size), loss cross-entropy on random tokens. Errors are relative: max over entries of
||a - b|| / ||b||. The floor is the same error between the reference and one process
that accumulates the gradient over `world` chunks of each batch (what data parallelism
sums, in another order); a check passes at max(1e-5, 3 x floor) (Adam's first steps move
each element by about lr * sign(g), so an element whose gradient is near zero flips with
the summation order: the AdamW floor is ~4e-5, SGD's ~2e-8). Strategies run with
`accumulate 1` and quantization off (tests/test_runtime_util.py's `strategy`).

parity      8 ranks; ZeRO-3 and PaRO-IIG and hpZ (`zeropp.shard`) on "node(2) > gpu(4)",
            ZeRO-topo (`zero_topo.shard`) on "node(2) > gpu(2) > gcd(2)"; `--steps` steps
            of AdamW and of SGD+momentum; `sm.full_state_dict()` against the reference's
            `state_dict()` (keys equal and in order: wq/wk/wv made by the model's hook).
meta-init   the model built on the meta device, `shardc.compile(..., init=titan_init)`
            (torchtitan's own per-module init: `_init_self_parameters`, `_init_self_buffers`):
            every value bit-equal to one process's `to_empty` + `apply(titan_init)` from the
            same seed, and the same logits.
full        8 ranks, ZeRO-3; the sharded model built with seed = rank (shardc broadcasts
            rank 0's values), the reference with seed 0: `full_state_dict()` equal to the
            unsharded model's `state_dict()` right after compile (bit for bit) and after
            `--steps` AdamW steps, and torch's `get_model_state_dict(sm,
            StateDictOptions(full_state_dict=True, cpu_offload=True))` bit-equal to
            `full_state_dict()` on rank 0 (empty elsewhere), both times.
dcp-save    ZeRO-3 at the launched world size ("node(2) > gpu(W/2)"): `--steps` AdamW steps,
            then torch's recipe (`get_state_dict(sm, opt)`, `dcp.save`) into DIR/shardc_zero3;
            rank 0 keeps the run's full parameters and optimizer state in
            DIR/shardc_zero3.full.pt for the resume to compare with.
dcp-resume  PaRO-IIG ("node(2) > gpu(W/2)"), built from another seed: `get_state_dict`,
            `dcp.load`, `set_state_dict` from DIR/shardc_zero3; after the load, parameters
            and AdamW state bit-equal to the saving run's; after `--steps` more steps,
            against an uninterrupted 2x`--steps` single-process run (parameters, AdamW
            moments, step).
fsdp2       FSDP2 (`fully_shard` per layer and the root, 1-D mesh of W) saved the way
            torchtitan's checkpointer saves (its `ModelWrapper.state_dict()`, i.e.
            `model.state_dict()` through the hooks, and its flat FQN-keyed optimizer dict,
            `get_flat_optim_state_dict`) after `--steps` AdamW steps; shardc (PaRO-IIG)
            resumes with torch's recipe (`get_state_dict(..., flatten_optimizer_state_dict=
            True)`: the same keys), model and optimizer (model only, through
            `get_model_state_dict`, is tried when that fails), and trains `--steps` more;
            then shardc saves after `--steps` steps the same way and FSDP2 resumes
            torchtitan's way (`dcp.load` into `model.state_dict()`, `model.load_state_dict(
            strict=False)`, `load_flat_optim_state_dict`). After each load, bit-equal to the
            saving side; after the resumed steps, against the 2x`--steps` run.
torch-save  one process: `dcp_to_torch_save` of DIR/shardc_zero3 (and DIR/shardc_for_fsdp2
            when there) into one file; `load_state_dict(strict=True)` into the plain model;
            bit-equal to the saving run's parameters and against the reference at `--steps`.

Every check ends with a line `CHECK: all ok` or `CHECK: FAILED` and exits 0 or 1.
Without torchtitan every check prints one sentence saying so and exits with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]
STRATEGIES = os.path.join(ROOT, "examples", "strategies")
CHECKS = ("parity", "full", "meta-init", "dcp-save", "dcp-resume", "fsdp2", "torch-save")
OPTIMS = {"adamw": ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
          "sgd": ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.01))}
TOL = 1e-5          # fp32 rounding of a different reduction order


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", choices=CHECKS, required=True)
    p.add_argument("--dir", default=None, help="checkpoint directory (dcp-*, fsdp2, torch-save)")
    p.add_argument("--steps", type=int, default=3, help="steps per optimizer / on each side of a checkpoint")
    p.add_argument("--layers", type=int, default=6, help="keep the first N layers of the debug model (6)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step over all ranks")
    p.add_argument("--strategies", default="zero3,paro_iig,hpz,zero_topo", help="parity: which")
    p.add_argument("--json", dest="json_out", default=None, help="write every figure here (rank 0)")
    return p.parse_args(argv)


# -- model, data, reference -----------------------------------------------------------------
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


def make_opt(kind: str, params):
    import torch
    cls, kw = OPTIMS[kind]
    return getattr(torch.optim, cls)(params, **kw)


def train_micro(model, tok, div: int = 1) -> None:
    import torch.nn.functional as F
    x, y = tok[:, :-1], tok[:, 1:]
    (F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / div).backward()


def train(model, opt, xs, rank: int = 0, world: int = 1) -> None:
    for tok in xs:
        train_micro(model, tok.chunk(world)[rank])
        opt.step()
        opt.zero_grad()


def plain(d: dict) -> dict:
    import torch
    from torch.distributed.tensor import DTensor
    out = {}
    for k, v in d.items():
        if isinstance(v, DTensor):
            v = v.full_tensor()                     # a collective (FSDP2's, or shardc's pieces)
        if isinstance(v, torch.Tensor):
            v = v.detach().clone()
        out[k] = v
    return out


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


def tol(floor: float) -> float:
    """Pass mark: float32 rounding (1e-5), or 3x the floor where the optimizer amplifies it
    (Adam's first steps move each element by about lr * sign(g): an element whose gradient
    is near zero flips with the summation order)."""
    return max(TOL, 3 * floor)


def rel_err(got: dict, want: dict) -> tuple[float, str]:
    """Max over tensor entries of ||a - b|| / ||b||, and the worst key."""
    import torch
    worst, where = 0.0, ""
    for k, w in want.items():
        if not isinstance(w, torch.Tensor) or w.dim() == 0:
            continue
        g = got[k]
        e = float((g.float() - w.float()).norm() / w.float().norm().clamp_min(1e-12))
        if e > worst:
            worst, where = e, k
    return worst, where


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


# -- shardc --------------------------------------------------------------------------------
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


def two_level(world: int) -> str:
    return f"node(2) > gpu({world // 2})"


def sharded(args, name: str, mesh: str, seed: int):
    import torch
    import shardc
    x = torch.zeros(args.global_batch // _world(), args.seq, dtype=torch.long)
    return shardc.compile(build(args, seed), strategy(name, mesh), example_inputs=(x,), timeout=1800)


def _world() -> int:
    import torch.distributed as dist
    return dist.get_world_size()


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank()


def say(line: str) -> None:
    if _rank() == 0:
        print(line, flush=True)


# -- checks --------------------------------------------------------------------------------
def _fmt(c: dict) -> str:
    if "error" in c:
        return c["error"]
    def one(k, v):
        if isinstance(v, float):
            return f"{k} {v:.1f}" if k == "seconds" or k.endswith("_s") else f"{k} {v:.2e}"
        return f"{k} {v}"
    return ", ".join(one(k, v) for k, v in c.items() if k != "ok")


def _verdict(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def _error(e: Exception) -> dict:
    if _rank() == 0:
        import traceback
        traceback.print_exc()
    return dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[:800]}", ok=False)


def check_parity(args) -> dict:
    world, rank = _world(), _rank()
    meshes = {"zero3": two_level(world), "paro_iig": two_level(world), "hpz": two_level(world),
              "zero_topo": f"node(2) > gpu({world // 4}) > gcd(2)"}
    out = {}
    refs = {kind: references(args, kind, args.steps, world=world) for kind in OPTIMS}
    for kind, (ref, floor) in refs.items():
        out[f"floor/{kind}"] = dict(params=floor[args.steps][0], ok=True)
        say(f"parity floor {kind}: one process accumulating {world} chunks vs the concatenated batch, "
            f"{args.steps} steps: params max rel err {floor[args.steps][0]:.2e} (pass mark "
            f"{tol(floor[args.steps][0]):.1e})")
    for name in args.strategies.split(","):
        for kind in OPTIMS:
            ref, floor = refs[kind]
            t0 = time.perf_counter()
            sm = sharded(args, name, meshes[name], seed=0)
            opt = make_opt(kind, sm.parameters())
            t1 = time.perf_counter()
            train(sm, opt, batches(args, args.steps), rank, world)
            t2 = time.perf_counter()
            got = plain(sm.full_state_dict())
            want = ref[args.steps][0]
            err, where = rel_err(got, want) if set(got) == set(want) else (float("inf"), "keys differ")
            keys = list(got) == list(want)
            r = dict(mesh=meshes[name], keys_equal=keys, max_rel_err=err, worst=where, compile_s=t1 - t0,
                     train_s=t2 - t1, ok=keys and err <= tol(floor[args.steps][0]))
            out[f"{name}/{kind}"] = r
            say(f"parity {name:<9} {kind:<5} on {meshes[name]} ({world} ranks): keys equal {keys} "
                f"({len(got)}, wq/wk/wv: {sum('.wq.' in k or '.wk.' in k or '.wv.' in k for k in got)}), "
                f"max rel err {err:.2e} ({where}); compile {r['compile_s']:.1f} s, {args.steps} steps "
                f"{r['train_s']:.1f} s  {_verdict(r['ok'])}")
            del sm, opt
    return out


def check_full(args) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    world, rank = _world(), _rank()
    mesh = two_level(world)
    ref, floor = references(args, "adamw", args.steps, marks=(0,), world=world)
    t0 = time.perf_counter()
    sm = sharded(args, "zero3", mesh, seed=rank)          # rank r's own init; rank 0's is broadcast
    out = dict(mesh=mesh, compile_s=time.perf_counter() - t0)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for when, i in (("after compile", 0), (f"after {args.steps} AdamW steps", args.steps)):
        if i:
            opt = make_opt("adamw", sm.parameters())
            train(sm, opt, batches(args, args.steps), rank, world)
        t0 = time.perf_counter()
        full = plain(sm.full_state_dict())
        t_full = time.perf_counter() - t0
        t0 = time.perf_counter()
        try:
            tsd = plain(get_model_state_dict(sm, options=opts))
            torch_ok = bit_equal(tsd, full) if rank == 0 else not tsd
        except Exception as e:                          # noqa: BLE001
            tsd, torch_ok = None, _error(e)["error"]
        t_torch = time.perf_counter() - t0
        want = ref[i][0]
        r = dict(keys_equal=list(full) == list(want), bit_equal=bit_equal(full, want),
                 max_rel_err=rel_err(full, want)[0] if set(full) == set(want) else float("inf"),
                 floor=floor[i][0], full_state_dict_s=t_full, torch_full_equal=torch_ok,
                 get_model_state_dict_s=t_torch)
        r["ok"] = r["keys_equal"] and torch_ok is True and \
            (r["bit_equal"] if i == 0 else r["max_rel_err"] <= tol(floor[i][0]))
        out[when] = r
        say(f"full {when}: full_state_dict() keys equal {r['keys_equal']}, bit-equal to the plain model's "
            f"state_dict() {r['bit_equal']}, max rel err {r['max_rel_err']:.2e} (floor {r['floor']:.2e}; "
            f"{t_full:.2f} s); get_model_state_dict(full_state_dict, cpu_offload) bit-equal to "
            f"full_state_dict() on rank 0 (empty elsewhere): {torch_ok} ({t_torch:.2f} s)  {_verdict(r['ok'])}")
    return out


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


def check_meta_init(args) -> dict:
    """The model built on meta, `init=titan_init`: every value equal to one process's
    to_empty + apply(titan_init) from the same seed, and the same logits."""
    import torch

    import shardc
    from torchtitan.experiments.graph_trainer.llama3 import model_registry

    def meta():
        spec = model_registry("debugmodel", attn_backend="sdpa")
        spec.model.layers = spec.model.layers[:args.layers]
        with torch.device("meta"):
            return spec.model.build()
    world = _world()
    x = batches(args, 1)[0][:2, :-1]
    model = meta()
    torch.manual_seed(11)
    t0 = time.perf_counter()
    sm = shardc.compile(model, strategy("zero3", two_level(world)), example_inputs=(x,), init=titan_init)
    secs = time.perf_counter() - t0
    ref = meta()
    torch.manual_seed(11)
    ref.to_empty(device="cpu")
    ref.apply(titan_init)
    full = plain(sm.full_state_dict())
    sm.eval()
    ref.eval()
    with torch.no_grad():
        logits = float((sm(x) - ref(x)).abs().max())
    ok = bit_equal(full, plain(ref.state_dict())) and logits == 0.0
    say(f"meta-init: values bit-equal to one process's to_empty + apply(titan_init) {ok}, logits differ by "
        f"{logits:.1e} (compile and init {secs:.1f} s)  {_verdict(ok)}")
    return dict(bit_equal=ok, logits_diff=logits, seconds=secs, ok=ok)


def _torch_recipe_save(model, opt, path, flatten=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _torch_recipe_load(model, opt, path, flatten=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    msd, osd = get_state_dict(model, opt, options=options)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


def _sm_state(sm, opt) -> tuple[dict, dict]:
    return plain(sm.full_state_dict()), {n: plain(st) for n, st in sm.full_optim_state_dict(opt)["state"].items()}


def _same(got: tuple[dict, dict], saved: tuple[dict, dict]) -> bool:
    """Parameters (state-dict keys) and optimizer states bit for bit."""
    (gp, gs), (sp, ss) = got, saved
    return bit_equal(gp, sp) and set(gs) == set(ss) and all(_same_state(gs[n], ss[n]) for n in ss)


def _same_state(got: dict, saved: dict) -> bool:
    """One parameter's optimizer state: tensors bit for bit, `step` by value."""
    import torch
    if set(got) != set(saved):
        return False
    for k, v in saved.items():
        g = got[k]
        if k == "step" or not isinstance(v, torch.Tensor) or v.dim() == 0:
            if float(g) != float(v):
                return False
        elif not torch.equal(g, v):
            return False
    return True


def _against(got: tuple[dict, dict], want: tuple[dict, dict], floor: tuple[float, float]) -> dict:
    (gp, gs), (wp, ws) = got, want
    p = rel_err(gp, wp)[0] if list(gp) == list(wp) else float("inf")
    m, steps_ok = optim_err(gs, ws)
    return dict(params=p, moments=m, steps_equal=steps_ok, floor_params=floor[0], floor_moments=floor[1],
                ok=p <= tol(floor[0]) and m <= tol(floor[1]) and steps_ok)


def check_dcp_save(args) -> dict:
    import torch
    world, rank = _world(), _rank()
    mesh = two_level(world)
    sm = sharded(args, "zero3", mesh, seed=0)
    opt = make_opt("adamw", sm.parameters())
    train(sm, opt, batches(args, args.steps), rank, world)
    path = os.path.join(args.dir, "shardc_zero3")
    t0 = time.perf_counter()
    _torch_recipe_save(sm, opt, path)
    r = dict(mesh=mesh, world=world, save_s=time.perf_counter() - t0)
    saved = _sm_state(sm, opt)
    if rank == 0:                                   # what the resume must hold after its load, bit for bit
        torch.save(dict(state=saved, world=world), path + ".full.pt")
    ref, floor = references(args, "adamw", args.steps, world=world)
    r["at_save"] = _against(saved, ref[args.steps], floor[args.steps])
    r["ok"] = r["at_save"]["ok"]
    say(f"dcp-save zero3 on {mesh} ({world} ranks): {args.steps} AdamW steps, get_state_dict + dcp.save "
        f"into {path} in {r['save_s']:.2f} s; against the reference: {_fmt(r['at_save'])}  {_verdict(r['ok'])}")
    return r


def check_dcp_resume(args) -> dict:
    import torch
    world, rank = _world(), _rank()
    mesh = two_level(world)
    path = os.path.join(args.dir, "shardc_zero3")
    saved = torch.load(path + ".full.pt")
    ref, floor = references(args, "adamw", 2 * args.steps, marks=(args.steps,), world=world)
    sm = sharded(args, "paro_iig", mesh, seed=100 + rank)
    opt = make_opt("adamw", sm.parameters())
    t0 = time.perf_counter()
    _torch_recipe_load(sm, opt, path)
    r = dict(mesh=mesh, world=world, saved_world=saved["world"], load_s=time.perf_counter() - t0)
    r["after_load_bit_equal_to_save"] = _same(_sm_state(sm, opt), saved["state"])
    t0 = time.perf_counter()
    train(sm, opt, batches(args, args.steps, args.steps), rank, world)
    r["train_s"] = time.perf_counter() - t0
    r["after_resume"] = _against(_sm_state(sm, opt), ref[2 * args.steps], floor[2 * args.steps])
    r["ok"] = r["after_load_bit_equal_to_save"] and r["after_resume"]["ok"]
    say(f"dcp-resume paro_iig on {mesh} ({world} ranks) from zero3 at {saved['world']} ranks ({path}): "
        f"get_state_dict + dcp.load + set_state_dict {r['load_s']:.2f} s; params and AdamW state bit-equal to "
        f"the saved run's: {r['after_load_bit_equal_to_save']}; after {args.steps} more steps "
        f"({r['train_s']:.1f} s) against the uninterrupted {2 * args.steps}-step run: {_fmt(r['after_resume'])}  "
        f"{_verdict(r['ok'])}")
    return r


# -- FSDP2, torchtitan's way --------------------------------------------------------------------
def _fsdp2(args, seed):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = build(args, seed)
    mesh = init_device_mesh("cpu", (_world(),), mesh_dim_names=("dp_shard",))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cls, kw = OPTIMS["adamw"]
    opt = getattr(torch.optim, cls)(model.named_parameters(), **kw)   # torchtitan builds it with names
    return model, opt


def _fsdp2_save(model, opt, path):
    """torchtitan's checkpointer: `ModelWrapper.state_dict()` (= model.state_dict(), hooks
    and all) and `OptimizersContainer.state_dict()` (its flat FQN-keyed optimizer dict)."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, init_optim_state
    init_optim_state(opt)
    dcp.save({"model": ModelWrapper(model).state_dict(), "optim": get_flat_optim_state_dict(opt)},
             checkpoint_id=path)


def _fsdp2_load(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer.utils import (get_flat_optim_state_dict, init_optim_state,
                                                        load_flat_optim_state_dict)
    wrapper = ModelWrapper(model)
    init_optim_state(opt)
    state = {"model": wrapper.state_dict(), "optim": get_flat_optim_state_dict(opt)}
    dcp.load(state, checkpoint_id=path)
    wrapper.load_state_dict(state["model"])                          # model.load_state_dict(strict=False)
    load_flat_optim_state_dict(opt, state["optim"])


def _fsdp2_state(model, opt) -> tuple[dict, dict]:
    params = plain(model.state_dict())
    names = {id(p): n for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
    return params, {names[id(p)]: plain(st) for p, st in opt.state.items()}


def check_fsdp2(args) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    world, rank = _world(), _rank()
    mesh = two_level(world)
    ref, floor = references(args, "adamw", 2 * args.steps, marks=(args.steps,), world=world)
    first, second = batches(args, args.steps), batches(args, args.steps, args.steps)
    end = (ref[2 * args.steps], floor[2 * args.steps])
    out = {}
    # FSDP2 -> shardc
    model, opt = _fsdp2(args, seed=0)
    train(model, opt, first, rank, world)
    saved = _fsdp2_state(model, opt)
    out["fsdp2_at_save"] = _against(saved, ref[args.steps], floor[args.steps])
    path = os.path.join(args.dir, "fsdp2_torchtitan")
    _fsdp2_save(model, opt, path)
    say(f"fsdp2 (1-D mesh of {world}) {args.steps} AdamW steps against the reference: {_fmt(out['fsdp2_at_save'])}; "
        f"saved torchtitan's way into {path}")
    del model, opt
    r = out["fsdp2_to_shardc"] = {}
    for tag in ("model+optim", "model only"):
        sm = sharded(args, "paro_iig", mesh, seed=100 + rank)
        sopt = make_opt("adamw", sm.parameters())
        try:
            if tag == "model+optim":
                _torch_recipe_load(sm, sopt, path, flatten=True)
                c = dict(after_load_bit_equal_to_save=_same(_sm_state(sm, sopt), saved))
            else:
                state = {"model": get_model_state_dict(sm)}
                dcp.load(state, checkpoint_id=path)
                set_model_state_dict(sm, state["model"])
                c = dict(after_load_bit_equal_to_save=bit_equal(plain(sm.full_state_dict()), saved[0]))
            train(sm, sopt, second, rank, world)
            c.update(_against(_sm_state(sm, sopt), *end))
            if tag == "model only":                    # fresh moments: only the load itself counts
                c = dict(after_load_bit_equal_to_save=c["after_load_bit_equal_to_save"],
                         ok=c["after_load_bit_equal_to_save"])
            else:
                c["ok"] = c["ok"] and c["after_load_bit_equal_to_save"]
        except Exception as e:                          # noqa: BLE001 — reported, the other checks go on
            c = _error(e)
        r[tag] = c
        say(f"fsdp2 -> shardc ({tag}: shardc paro_iig on {mesh} loads with get_state_dict(flatten_optimizer_"
            f"state_dict=True) + dcp.load + set_state_dict): {_fmt(c)}  {_verdict(c['ok'])}")
        del sm, sopt
        if c["ok"]:
            break
    # shardc -> FSDP2
    sm = sharded(args, "paro_iig", mesh, seed=0)
    sopt = make_opt("adamw", sm.parameters())
    train(sm, sopt, first, rank, world)
    path = os.path.join(args.dir, "shardc_for_fsdp2")
    try:
        _torch_recipe_save(sm, sopt, path, flatten=True)
        saved = _sm_state(sm, sopt)
        if rank == 0:                               # for --check torch-save
            import torch
            torch.save(dict(state=saved, world=world), path + ".full.pt")
        model, opt = _fsdp2(args, seed=5)
        _fsdp2_load(model, opt, path)
        c = dict(after_load_bit_equal_to_save=_same(_fsdp2_state(model, opt), saved))
        train(model, opt, second, rank, world)
        c.update(_against(_fsdp2_state(model, opt), *end))
        c["ok"] = c["ok"] and c["after_load_bit_equal_to_save"]
    except Exception as e:                              # noqa: BLE001
        c = _error(e)
    out["shardc_to_fsdp2"] = c
    say(f"shardc -> fsdp2 (shardc paro_iig on {mesh} saves with get_state_dict(flatten_optimizer_state_dict="
        f"True) + dcp.save; FSDP2 loads torchtitan's way): {_fmt(c)}  {_verdict(c['ok'])}")
    out["ok"] = out["fsdp2_at_save"]["ok"] and out["shardc_to_fsdp2"]["ok"] and \
        any(v["ok"] for v in out["fsdp2_to_shardc"].values())
    return out


def check_torch_save(args) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = {}
    for name in ("shardc_zero3", "shardc_for_fsdp2"):
        src = os.path.join(args.dir, name)
        if not os.path.isdir(src):
            continue
        dst = os.path.join(args.dir, f"{name}.pt")
        t0 = time.perf_counter()
        try:
            dcp_to_torch_save(src, dst)
            model = build(args, 9)
            res = model.load_state_dict(torch.load(dst)["model"], strict=True)
            got = plain(model.state_dict())
            r = dict(load=str(res), seconds=time.perf_counter() - t0)
            full = torch.load(src + ".full.pt")             # the saving run's own full_state_dict()
            r["bit_equal_to_saved_run"] = bit_equal(got, full["state"][0])
            world = full["world"]
            ref, floor = references(args, "adamw", args.steps, world=world)
            want = ref[args.steps][0]
            r.update(keys_equal=list(got) == list(want), max_rel_err=rel_err(got, want)[0],
                     floor=floor[args.steps][0])
            r["ok"] = r["keys_equal"] and r["max_rel_err"] <= tol(r["floor"]) and r["bit_equal_to_saved_run"]
        except Exception as e:                          # noqa: BLE001
            r = dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[:800]}", ok=False)
        out[name] = r
        print(f"torch-save {src} -> {dst}, load_state_dict(strict=True) into the plain model: {_fmt(r)}  "
              f"{_verdict(r['ok'])}", flush=True)
    if not out:
        print(f"torch-save: no shardc checkpoint under {args.dir} (run --check dcp-save first)", flush=True)
    out["ok"] = bool(out) and all(v["ok"] for v in out.values())
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        print("torchtitan_check: needs torchtitan (pip install torchtitan; it is no test dependency), "
              "and it is not importable here", flush=True)
        return 2
    if args.check in ("dcp-save", "dcp-resume", "fsdp2", "torch-save") and not args.dir:
        print(f"torchtitan_check: --check {args.check} needs --dir", flush=True)
        return 2
    import torch
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    if args.check == "torch-save":
        res = check_torch_save(args)
        rank = 0
    else:
        import torch.distributed as dist
        import shardc
        with shardc.distributed("gloo"):
            rank = dist.get_rank()
            if args.dir and rank == 0:
                os.makedirs(args.dir, exist_ok=True)
            fn = {"parity": check_parity, "full": check_full, "meta-init": check_meta_init, "dcp-save": check_dcp_save,
                  "dcp-resume": check_dcp_resume, "fsdp2": check_fsdp2}[args.check]
            res = fn(args)
            ok = res["ok"] if "ok" in res else all(v.get("ok", False) for v in res.values() if isinstance(v, dict))
            res = dict(check=args.check, world=dist.get_world_size(), layers=args.layers, seq=args.seq,
                       global_batch=args.global_batch, steps=args.steps, results=res, ok=ok,
                       seconds=time.perf_counter() - t0)
            say(f"{args.check}: {'all ok' if ok else 'FAILED'} in {res['seconds']:.0f} s")
            if args.json_out and rank == 0:
                with open(args.json_out, "w") as f:
                    json.dump(res, f, indent=1, default=str)
            dist.barrier()
            sys.exit(0 if ok else 1)
    ok = res.get("ok", False)
    print(f"{args.check}: {'all ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(dict(check=args.check, results=res, ok=ok), f, indent=1, default=str)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
