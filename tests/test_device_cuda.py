"""Device-generic runtime on a GPU: parity of every named strategy with CUDA tensors (gloo
ranks sharing the GPU), bf16 params/grads/comm with an fp32 master, collectives issued on
the comm streams, memory_report() against the CUDA allocator, and no host
synchronisation added to a step. Every test skips with its reason where CUDA is absent
(CI); bench/gpu_check.py runs the benchmarks (docs/BENCHMARKS.md, "GPU")."""
from __future__ import annotations

import copy
import gc

import pytest
import torch

from shardc.runtime.transport import device
from tests.harness import dist_run
from tests.test_device import M22, _train
from tests.test_runtime_parity import TWO_LEVEL
from tests.test_runtime_util import Tiny, batches, reference, strategy, train_sharded, units_for

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA: runs the sharded model on a GPU (no GPU on this machine)")]


CUDA_PARITY = ((M22, 4, tuple(TWO_LEVEL)), ("node(2) > gpu(2) > gcd(2)", 8, ("zero_topo",)))


def _cuda_parity(rank, world, names, mesh):
    return [(name, _train(rank, world, name, None, dev="cuda", mesh=mesh)[2]) for name in names]


@pytest.mark.parametrize("mesh,world,names", CUDA_PARITY)
def test_cuda_parity_every_named_strategy(mesh, world, names):
    """gloo ranks sharing the GPU (CUDA tensors), each named strategy vs one process."""
    for rank_res in dist_run(world, _cuda_parity, names, mesh, timeout=900):
        assert [n for n, _ in rank_res] == list(names)
        assert all(err < 1e-5 for _, err in rank_res), rank_res


def _cuda_bf16(rank, world):
    import dataclasses

    from shardc.dsl.ir import DType
    from shardc.runtime import shard_module
    model = Tiny().cuda()
    data = [(x.cuda(), y.cuda()) for x, y in batches(3, world, 2)]
    want, _ = reference(model, data, "adamw")
    s = strategy("zero3", M22, accumulate=2)
    bf = dict(dtype=DType.BF16, comm=DType.BF16)
    sc = dataclasses.replace(s.scopes, params=dataclasses.replace(s.params, **bf),
                             grads=dataclasses.replace(s.grads, **bf))
    sm = shard_module(copy.deepcopy(model), dataclasses.replace(s, scopes=sc), units_for(model, sc))
    got, _, opt = train_sharded(sm, data, rank, world, 2, "adamw")
    diff = max(float((got[k].float() - want[k]).abs().max()) for k in want)
    masters = {str(p.dtype) for g in opt.param_groups for p in g["params"]}
    return diff, {str(v.dtype) for v in got.values()}, masters


def test_cuda_mixed_precision_bf16_params_and_comm_fp32_master():
    for diff, dtypes, masters in dist_run(4, _cuda_bf16, timeout=300):
        assert diff < 0.02 and "torch.bfloat16" in dtypes and masters == {"torch.float32"}, (diff, dtypes)


def _cuda_streams(rank, world):
    import torch.distributed as dist
    seen, saved = [], {}
    default = torch.cuda.current_stream()
    for op in ("all_gather_single", "all_to_all_single", "reduce_scatter_single", "all_reduce"):
        fn = saved[op] = getattr(dist, op)

        def wrapped(*a, _fn=fn, **kw):
            seen.append(torch.cuda.current_stream() != default)
            return _fn(*a, **kw)
        setattr(dist, op, wrapped)
    try:
        err = _train(rank, world, "zero3", None, dev="cuda")[2]
    finally:
        for op, fn in saved.items():
            setattr(dist, op, fn)
    pool = device.comm_streams(torch.device("cuda", torch.cuda.current_device()))
    streams = {pool.stream(k) for k in device.STREAM_KINDS} | {default}
    return err, seen, len(streams)


def test_cuda_collectives_issue_on_comm_streams():
    for err, seen, n_streams in dist_run(4, _cuda_streams, timeout=300):
        assert err < 1e-5 and seen and all(seen) and n_streams == 4


def _cuda_memory(rank, world):
    from shardc.runtime import shard_module
    from tests.test_runtime_memory import expected
    gc.collect()                      # earlier jobs' garbage must not be freed inside the window
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = Tiny(d=8, h=8).cuda()
    s = strategy("zero3", M22, accumulate=1)
    sm = shard_module(model, s, units_for(model, s.scopes))
    del model
    data = [(x.cuda(), y.cuda()) for x, y in batches(1, world, 1)]
    train_sharded(sm, data, rank, world, 1, "adamw")
    del data
    gc.collect()
    held = torch.cuda.memory_allocated() - base
    blocks = torch.cuda.memory_stats()["active.all.current"]
    return sm.memory_report(), expected("zero3", [104, 160, 160, 160], "adamw"), held, blocks


def test_cuda_memory_report_matches_the_allocator():
    """After a step, the allocator holds the reported model state plus at most one
    512-byte rounding per live block (and the 4-byte `scale` buffer)."""
    for rep, want, held, blocks in dist_run(4, _cuda_memory, timeout=300):
        assert rep == want
        assert rep["total"] <= held <= rep["total"] + 512 * blocks + 512, (rep, held, blocks)


def _cuda_sync_warnings(rank, world):
    """Synchronising CUDA calls in steps 2-3 (world 1): eager PyTorch vs shardc."""
    import warnings

    from shardc.runtime import shard_module
    from tests.test_runtime_util import loss_fn, make_opt
    model = Tiny().cuda()
    x, y = (t.cuda() for t in batches(1, 1, 1)[0])
    s = strategy("zero3", "gpu(1)", accumulate=1)
    sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
    counts = []
    for fwd, opt, clip in ((model, make_opt("adamw", model.parameters()),
                            lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),
                           (sm, make_opt("adamw", sm), lambda: sm.clip_grad_norm_(1.0))):
        for step in range(3):
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn" if step else "default")
                loss_fn(fwd(x), y).backward()
                clip()
                opt.step()
                opt.zero_grad()
                torch.cuda.set_sync_debug_mode("default")
            if step:
                counts.append(sum("synchroniz" in str(w.message) for w in got))
    return counts


def test_cuda_step_adds_no_host_synchronisation():
    (counts,) = dist_run(1, _cuda_sync_warnings, timeout=300)
    eager, sharded = counts[:2], counts[2:]
    assert sharded == eager, f"synchronising calls per step: eager {eager}, shardc {sharded}"
