"""GPU checks of the device-generic runtime (information; CI has no GPU, tests skip there).

    python bench/gpu_check.py step   [--steps 20] [--warmup 5] [--batch 8] [--seq 1024]
    python bench/gpu_check.py parity
    python bench/gpu_check.py trace  [--world 2] [--out bench/results/gpu_trace]
    python bench/gpu_check.py inductor [--steps 20] [--warmup 5] [--batch 8] [--seq 1024]

step   (a) world 1 on CUDA (NCCL), a GPT-2-small-sized model (124M: 12 layers, width
       768, vocab 50257): median step time (forward, backward, clip, AdamW) of the
       model compiled with shardc (`shardc.compile`, zero3 on mesh gpu(1)) against the
       same model in eager PyTorch; `memory_report()` against the cost model's
       prediction; the predicted peak (model states + transient window + activations,
       the activations measured as the eager run's peak minus its model states) against
       `torch.cuda.max_memory_allocated()`.
parity (b) every named strategy on ranks sharing the GPU (gloo over CUDA tensors; NCCL
       refuses two ranks on one device) against one process on the concatenated batch:
       the CUDA tests' own rank function (tests/test_device_cuda.py), one line per strategy.
trace  (c) `--world` ranks (NCCL with one GPU each when there are enough GPUs, else
       gloo sharing GPU 0) train the 124M model under zero3 for 2 profiled steps; every
       rank writes a chrome trace (`OUT/rank<r>.json`) and rank 0 prints, per CUDA
       stream, its busy time and top kernels, and how long work on the other streams
       (all-gathers, reduce-scatters, their copies) ran while the compute stream was busy.
inductor (d) the whole-step compiled mode at world 1 (NCCL), the 124M model: per mode
       (`eager` PyTorch, `compile` = torch.compile(model), `shardc` = the eager runtime,
       `shardc+inductor` = `shardc.compile(..., backend="inductor")`) the first step's time
       (where dynamo and Inductor compile), the median step time and its ratio to eager and
       to torch.compile, `max_memory_allocated`, and parity: each mode's losses over its
       first 5 steps (same weights, same batch, TF32 off) against eager's, max relative
       difference (< 1e-4 passes).

Without CUDA every mode prints one line saying so and exits with status 2.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples")]
GPT2_SMALL = dict(vocab_size=50257, n_layer=12, n_head=12, n_embd=768)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("step", "parity", "trace", "inductor"))
    p.add_argument("--steps", type=int, default=20, help="timed steps (step mode)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (step mode)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq", type=int, default=1024, help="sequence length")
    p.add_argument("--world", type=int, default=2, help="ranks (trace mode)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu_trace"),
                   help="trace directory (trace mode)")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(seq: int):
    import gpt
    import torch
    torch.manual_seed(0)
    return gpt.GPT(gpt.GPTConfig(block_size=seq, **GPT2_SMALL)).cuda()


def _batch(args, seed: int = 0):
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, GPT2_SMALL["vocab_size"], (args.batch, args.seq + 1), generator=g).cuda()
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _step_fn(fwd, clip, opt, x, y):
    import torch.nn.functional as F

    def step():
        F.cross_entropy(fwd(x).flatten(0, 1), y.flatten()).backward()
        clip(1.0)
        opt.step()
        opt.zero_grad()
    return step


def _timed(step, args) -> tuple[float, int]:
    """Median step seconds and the peak allocated bytes over the timed steps."""
    import torch
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated()


def _opt_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
               if hasattr(v, "dim") and v.dim() > 0 and v.is_cuda)


def _eager(args, x, y) -> dict:
    import torch
    model = _model(args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    clip = lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c)  # noqa: E731
    sec, peak = _timed(_step_fn(model, clip, opt, x, y), args)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    states = 2 * params + _opt_bytes(opt)                 # params + grads + AdamW moments
    return dict(seconds=sec, peak=peak, states=states, activations=peak - states,
                n_params=sum(p.numel() for p in model.parameters()))


def _compiled(args, x, y) -> dict:
    import torch

    import shardc
    from shardc.analysis.costmodel.memory import predict_memory
    from shardc.analysis.costmodel.report import model_units
    strategy = shardc.load_strategy(os.path.join(ROOT, "examples", "strategies", "zero3.shard"),
                                    mesh="gpu(1)")
    model = _model(args.seq)
    predicted = predict_memory(strategy.mesh, model_units(strategy, model), prefetch=strategy.prefetch)
    sm = shardc.compile(model, strategy, example_inputs=(x,))
    opt = sm.optimizer(torch.optim.AdamW, lr=1e-4)
    sec, peak = _timed(_step_fn(sm, sm.clip_grad_norm_, opt, x, y), args)
    return dict(seconds=sec, peak=peak, report=sm.memory_report(), predicted=predicted)


def _init_world_1() -> None:
    import torch.distributed as dist
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)


def run_step(args) -> int:
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    _init_world_1()
    try:
        x, y = _batch(args)
        eager = _eager(args, x, y)
        torch.cuda.empty_cache()
        comp = _compiled(args, x, y)
    finally:
        dist.destroy_process_group()
    gib = 2**30
    rep, pred = comp["report"], comp["predicted"]
    want_peak = pred["total"] + pred["transient"] + eager["activations"]
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
          f"model {eager['n_params'] / 1e6:.1f}M params; batch {args.batch} x {args.seq} tokens")
    print(f"(a) step time: eager {eager['seconds'] * 1e3:.1f} ms, shardc {comp['seconds'] * 1e3:.1f} ms, "
          f"ratio {comp['seconds'] / eager['seconds']:.3f} (target <= 1.03)")
    print(f"    memory_report {rep}")
    print(f"    predicted     {pred}  (equal: {all(rep[k] == pred[k] for k in rep)})")
    print(f"    eager: peak {eager['peak'] / gib:.2f} GiB, model states {eager['states'] / gib:.2f} GiB, "
          f"activations {eager['activations'] / gib:.2f} GiB")
    print(f"    shardc: max_memory_allocated {comp['peak'] / gib:.2f} GiB vs predicted "
          f"{want_peak / gib:.2f} GiB (ratio {comp['peak'] / want_peak:.3f})")
    return 0


def run_parity(args) -> int:
    from tests.harness import dist_run
    from tests.test_device_cuda import CUDA_PARITY, _cuda_parity
    worst = 0.0
    for mesh, world, names in CUDA_PARITY:
        results = dist_run(world, _cuda_parity, names, mesh, timeout=1800)
        for i, name in enumerate(names):
            err = max(r[i][1] for r in results)
            worst = max(worst, err)
            print(f"(b) {name:<11} on {mesh} ({world} ranks, gloo over CUDA): max rel err {err:.2e} "
                  f"{'ok' if err < 1e-5 else 'FAIL'}")
    return 0 if worst < 1e-5 else 1


INDUCTOR_MODES = ("eager", "compile", "shardc", "shardc+inductor")
PARITY_STEPS = 5


def _inductor_mode(mode: str, args, x, y) -> dict:
    """(d) one mode: first step, parity losses, then the timed steps."""
    import torch
    import torch.nn.functional as F

    import shardc
    model = _model(args.seq)
    if mode.startswith("shardc"):
        strategy = shardc.load_strategy(os.path.join(ROOT, "examples", "strategies", "zero3.shard"),
                                        mesh="gpu(1)")
        fwd = shardc.compile(model, strategy, example_inputs=(x,),
                             backend="inductor" if mode == "shardc+inductor" else "eager")
        opt, clip = fwd.optimizer(torch.optim.AdamW, lr=1e-4), fwd.clip_grad_norm_
    else:
        fwd = torch.compile(model) if mode == "compile" else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        clip = lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c)  # noqa: E731

    def step():
        loss = F.cross_entropy(fwd(x).flatten(0, 1), y.flatten())
        loss.backward()
        clip(1.0)
        opt.step()
        opt.zero_grad()
        return loss.detach()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    losses = [step()]
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    losses += [step() for _ in range(PARITY_STEPS - 1)]
    sec, peak = _timed(step, args)
    return dict(first=first, seconds=sec, peak=peak, losses=[float(v) for v in losses])


def run_inductor(args) -> int:
    import torch
    import torch.distributed as dist
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False       # parity in fp32
    torch.backends.cudnn.allow_tf32 = False
    _init_world_1()
    res = {}
    try:
        x, y = _batch(args)
        for mode in INDUCTOR_MODES:
            res[mode] = _inductor_mode(mode, args, x, y)
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; batch {args.batch} x {args.seq} "
          f"tokens; zero3 on gpu(1); median of {args.steps} steps after {args.warmup}")
    e, c = res["eager"], res["compile"]
    worst = 0.0
    for mode, r in res.items():
        err = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], e["losses"]))
        worst = max(worst, err) if mode == "shardc+inductor" else worst
        print(f"(d) {mode:<16} first step {r['first']:7.2f} s, step {r['seconds'] * 1e3:8.1f} ms, "
              f"vs eager {r['seconds'] / e['seconds']:.3f}, vs compile {r['seconds'] / c['seconds']:.3f}, "
              f"max_memory_allocated {r['peak'] / 2**30:.2f} GiB; losses vs eager: max rel diff {err:.1e} "
              f"{'ok' if err < 1e-4 else 'FAIL'}")
    return 0 if worst < 1e-4 else 1


def _union(intervals):
    """Merged, sorted [start, end) intervals."""
    out = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [tuple(iv) for iv in out]


def _overlap(a, b) -> int:
    """Length of the intersection of two merged interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(events) -> list[str]:
    """events: (stream, start_ns, end_ns, name) of GPU work. The compute stream is the
    busiest; the rest (NCCL's streams, gloo's copies, shardc's comm streams) are side streams."""
    if not events:
        return ["    no CUDA work in the trace"]
    by_stream: dict[int, list] = {}
    for stream, lo, hi, name in events:
        by_stream.setdefault(stream, []).append((lo, hi, name))
    busy = {s: _union([(lo, hi) for lo, hi, _ in evs]) for s, evs in by_stream.items()}
    length = {s: sum(hi - lo for lo, hi in ivs) for s, ivs in busy.items()}
    compute = max(length, key=length.get)
    side = _union([iv for s, ivs in busy.items() if s != compute for iv in ivs])
    lines = []
    for s in sorted(by_stream, key=lambda k: -length[k]):
        names: dict[str, int] = {}
        for lo, hi, name in by_stream[s]:
            names[name[:40]] = names.get(name[:40], 0) + hi - lo
        top = ", ".join(f"{n} {t / 1e6:.2f} ms" for n, t in sorted(names.items(), key=lambda kv: -kv[1])[:3])
        tag = "compute" if s == compute else "side"
        lines.append(f"    stream {s} ({tag}): {len(by_stream[s])} ops, busy {length[s] / 1e6:.2f} ms; {top}")
    ov = _overlap(busy[compute], side)
    side_len = sum(hi - lo for lo, hi in side)
    lines.append(f"    side streams busy {side_len / 1e6:.2f} ms, of which {ov / 1e6:.2f} ms "
                 f"({ov / max(side_len, 1):.0%}) overlapped the compute stream")
    return lines


def _gpu_events(prof):
    return [(e.device_resource_id(), e.start_ns(), e.end_ns(), e.name())
            for e in prof.profiler.kineto_results.events() if "CUDA" in str(e.device_type())]


def _trace_rank(rank, world, args, port, backend):
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import shardc
    torch.cuda.set_device(rank if backend == "nccl" else 0)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        strategy = shardc.load_strategy(os.path.join(ROOT, "examples", "strategies", "zero3.shard"),
                                        mesh=f"gpu({world})")
        x, y = _batch(args, seed=rank)
        sm = shardc.compile(_model(args.seq), strategy, example_inputs=(x,))
        opt = sm.optimizer(torch.optim.AdamW, lr=1e-4)
        step = _step_fn(sm, sm.clip_grad_norm_, opt, x, y)
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        os.makedirs(args.out, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.out, f"rank{rank}.json"))
        if rank == 0:
            print(f"(c) zero3 on gpu({world}), {backend}, 2 profiled steps; traces in {args.out}")
            print("\n".join(summarize(_gpu_events(prof))))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_trace(args) -> int:
    import torch
    import torch.multiprocessing as mp
    backend = "nccl" if torch.cuda.device_count() >= args.world else "gloo"
    mp.spawn(_trace_rank, args=(args.world, args, _free_port(), backend), nprocs=args.world)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print(f"gpu_check: needs CUDA, and torch.cuda.is_available() is False here (torch "
              f"{torch.__version__}); run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    return {"step": run_step, "parity": run_parity, "trace": run_trace, "inductor": run_inductor}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
