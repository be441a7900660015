"""torchtitan's Llama 3 under shardc, end to end (information; issue 36; torchtitan is no test dependency).

    python -m torch.distributed.run --nproc-per-node 8 bench/clients/torchtitan_check.py --check parity
    python -m torch.distributed.run --nproc-per-node 8 bench/clients/torchtitan_check.py --check full
    python -m torch.distributed.run --nproc-per-node 8 bench/clients/torchtitan_check.py --check dcp-save   --dir DIR
    python -m torch.distributed.run --nproc-per-node 4 bench/clients/torchtitan_check.py --check dcp-resume --dir DIR
    python -m torch.distributed.run --nproc-per-node 8 bench/clients/torchtitan_check.py --check fsdp2      --dir DIR
    python bench/clients/torchtitan_check.py --check torch-save --dir DIR        # one process, after dcp-save / fsdp2

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
import json
import os
import sys
import time

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
from titan_common import OPTIMS, error, get_rank, get_world, make_opt, plain, rel_err, say, tol, two_level, verdict  # noqa: E402
from titan_llama import (ROOT, batches, bit_equal, references, sharded, strategy, titan_init,  # noqa: E402
                         train)
from torchtitan_checkpoints import check_dcp_resume, check_dcp_save, check_fsdp2, check_torch_save  # noqa: E402
sys.path[:0] = [ROOT]

CHECKS = ("parity", "full", "meta-init", "dcp-save", "dcp-resume", "fsdp2", "torch-save")


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


def check_parity(args) -> dict:
    world, rank = get_world(), get_rank()
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
                f"{r['train_s']:.1f} s  {verdict(r['ok'])}")
            del sm, opt
    return out


def check_full(args) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    world, rank = get_world(), get_rank()
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
            tsd, torch_ok = None, error(e)["error"]
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
            f"full_state_dict() on rank 0 (empty elsewhere): {torch_ok} ({t_torch:.2f} s)  {verdict(r['ok'])}")
    return out


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
    world = get_world()
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
        f"{logits:.1e} (compile and init {secs:.1f} s)  {verdict(ok)}")
    return dict(bit_equal=ok, logits_diff=logits, seconds=secs, ok=ok)


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
