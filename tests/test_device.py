"""Device-generic runtime (runtime/transport/device.py): the model's device, the backend per device
type, native vs all-to-all reduce-scatter (same values, same ledger), and the
communication-stream wrapper driven by a fake stream module on CPU gloo ranks, and
bench/gpu_check.py where there is no GPU. The same checks on a GPU are in
tests/test_device_cuda.py."""
from __future__ import annotations

import contextlib
import copy
import weakref

import pytest
import torch
from torch import nn

from shardc.dsl.errors import ShardcError
from shardc.lowering import Op
from shardc.runtime.transport import device
from tests.harness import dist_run
from tests.test_runtime_util import (ROOT, Tiny, batches, max_rel_err, reference, strategy,
                                     train_sharded, units_for)

M22 = "node(2) > gpu(2)"


# -- a fake stream module (the torch.cuda stream API, recording what is asked of it) ------
class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def record_event(self):
        ev = ("event", self.name, len(self.log))
        self.log.append(("record", self.name, ev))
        return ev

    def wait_event(self, ev):
        self.log.append(("wait_event", self.name, ev))


class FakeStreams:
    """Stands in for torch.cuda: Stream(), current_stream(), stream(s)."""

    def __init__(self):
        self.log: list = []
        self.made: list[FakeStream] = []
        self._current = [FakeStream("default", self.log)]

    def Stream(self, device=None, priority=0):                       # noqa: N802 (torch.cuda's name)
        s = FakeStream(f"comm{len(self.made)}", self.log)
        self.made.append(s)
        return s

    def current_stream(self, device=None):
        return self._current[-1]

    @contextlib.contextmanager
    def stream(self, s):
        self._current.append(s)
        try:
            yield
        finally:
            self._current.pop()


# -- no process group needed --------------------------------------------------------------
def test_model_device_follows_the_parameters():
    assert device.model_device(nn.Linear(2, 2)) == torch.device("cpu")
    assert device.model_device(nn.Tanh()) == torch.device("cpu")         # no parameters
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    with pytest.raises(ShardcError, match="meta device .* materialise"):
        device.model_device(meta)
    mixed = nn.Sequential(nn.Linear(2, 2), meta)
    with pytest.raises(ShardcError, match="parameters on cpu and meta; move it to one device"):
        device.model_device(mixed)


def test_default_backends():
    assert device.default_backend("cuda") == "nccl"
    assert device.default_backend("cpu") == "gloo"


def test_cpu_collectives_run_without_streams():
    assert device.comm_streams(torch.device("cpu")) is None
    assert device.launch(Op.ALL_GATHER, torch.zeros(2)) is device.NO_STREAM


def test_on_stream_orders_and_keeps_tensors_alive():
    fake = FakeStreams()
    with device.use_stream_module("cpu", fake):
        t = torch.zeros(3)
        ref = weakref.ref(t)
        on = device.launch(Op.REDUCE_SCATTER, t)
        assert fake.log == [("wait_stream", "comm0", "default")]      # after the issuing stream
        with on.active():
            assert fake.current_stream().name == "comm0"
        assert fake.current_stream().name == "default"
        del t
        assert ref() is not None, "the collective's tensors must live until the join"
        on.join()
        assert ref() is None
        ev = fake.log[1][2]
        assert fake.log[1:] == [("record", "comm0", ev), ("wait_event", "default", ev)]
        on.join()                                                     # idempotent
        assert len(fake.log) == 3
        pool = device.comm_streams(torch.device("cpu"))
        kinds = {k: pool.stream(k).name for k in device.STREAM_KINDS}
        assert len(set(kinds.values())) == 3 and pool.stream(Op.ALL_GATHER).name == kinds[Op.ALL_GATHER]
    assert device.comm_streams(torch.device("cpu")) is None            # uninstalled
    with device.use_stream_module("cpu", FakeStreams()), device.use_stream_module("cpu", None):
        assert device.launch(Op.ALL_REDUCE, torch.zeros(1)) is device.NO_STREAM   # turned off


# -- gloo ranks -------------------------------------------------------------------------
def _backends(rank, world):
    import torch.distributed as dist

    from shardc.dsl import parse_mesh_text
    from shardc.runtime.transport.mesh import ShardMesh

    sm = ShardMesh(parse_mesh_text(M22))
    names = [device.backend_name(sm.group(lv, order), "cpu")
             for lv, order in ((("node",), None), (("gpu",), None), (("node", "gpu"), None),
                               (("node", "gpu"), ("gpu", "node")))]
    default = dist.distributed_c10d._get_default_group()
    native = [device.native_reduce_scatter(default, "cpu")]
    with device.prefer_native_reduce_scatter(True):
        native.append(device.native_reduce_scatter(default, "cpu"))
    native.append(device.native_reduce_scatter(default, "cpu"))
    errors = []
    for bad in (lambda: device.check_backend("meta"), lambda: ShardMesh(sm.mesh, "meta")):
        try:
            bad()
        except ShardcError as e:
            errors.append(str(e))
    return names, native, errors, _shard_meta_model()


def _shard_meta_model() -> str:
    """A model on the meta device is sharded on the mesh's device (gloo: the CPU)."""
    from shardc.runtime import shard_module
    with torch.device("meta"):
        model = Tiny()
    s = strategy("zero3", M22)
    try:
        sm = shard_module(model, s, units_for(model, s.scopes))
    except ShardcError as e:
        return str(e)
    return ",".join(sorted({str(g.storage.shard.device) for u in sm.runtime.units for g in u.groups}))
    return "no error"


@pytest.mark.distributed
def test_groups_and_reduce_scatter_choice_follow_the_backend():
    for names, native, errors, meta in dist_run(4, _backends):
        assert names == ["gloo"] * 4
        assert native == [False, True, False]
        assert len(errors) == 2
        for e in errors:
            assert "no backend for meta tensors" in e and "init_process_group" in e
        assert meta == "cpu", meta


def _counting(dist, counts):
    """Wrap the c10d ops the collectives issue so the test sees which path ran."""
    saved = {}
    for op in ("reduce_scatter_single", "all_to_all_single"):
        fn = saved[op] = getattr(dist, op)

        def wrapped(*a, _fn=fn, _op=op, **kw):
            counts[_op] = counts.get(_op, 0) + 1
            return _fn(*a, **kw)
        setattr(dist, op, wrapped)
    return saved


def _native_vs_alltoall(rank, world):
    import torch.distributed as dist

    from shardc.dsl import parse_mesh_text
    from shardc.dsl.ir import Collectives, DType
    from shardc.runtime.eager import collectives as C
    from shardc.runtime.transport.mesh import ShardMesh
    from tests.test_collectives import cases, data, members

    sm = ShardMesh(parse_mesh_text(M22))
    counts: dict[str, dict] = {"native": {}, "alltoall": {}}
    bad, n = [], 0
    for case, (levels, order) in enumerate(cases(sm.mesh)):
        grp = members(sm.mesh, rank, order)
        s, m = len(grp), 6
        full = [data(r, case, s * m).round() for r in grp]            # integers: sums are exact
        want = sum(x[grp.index(rank) * m:(grp.index(rank) + 1) * m] for x in full)
        for algo in (Collectives.RING, Collectives.HIERARCHICAL, Collectives.HO_RING):
            for comm in (DType.FP32, DType.BF16):
                got = {}
                for path, flag in (("native", True), ("alltoall", False)):
                    saved = _counting(dist, counts[path])
                    try:
                        with device.prefer_native_reduce_scatter(flag):
                            out = torch.full((m,), float("nan"))
                            C.reduce_scatter(out, full[grp.index(rank)], sm, levels, order,
                                             algo=algo, comm=comm).wait()
                            ar = full[grp.index(rank)].clone()
                            C.all_reduce(ar, sm, levels, algo=algo).wait()
                    finally:
                        for op, fn in saved.items():
                            setattr(dist, op, fn)
                    got[path] = (out, ar)
                    n += 1
                exact = comm is DType.FP32
                if not torch.equal(got["native"][0], got["alltoall"][0]) or \
                        (exact and not torch.equal(got["native"][0], want)) or \
                        not torch.equal(got["native"][1], got["alltoall"][1]):
                    bad.append((levels, order, algo, comm))
    return bad, n, counts


@pytest.mark.distributed
def test_native_reduce_scatter_equals_alltoall_path():
    """gloo's native reduce_scatter is correct (an all-reduce and a slice), so forcing it
    exercises the NCCL code path on CPU; both paths give the same (exact) sums."""
    for bad, n, counts in dist_run(4, _native_vs_alltoall, timeout=600):
        assert n > 0 and not bad, f"native and all-to-all reduce-scatters differ: {bad}"
        assert counts["native"].get("reduce_scatter_single", 0) > 0
        assert counts["native"].get("all_to_all_single", 0) == 0
        assert counts["alltoall"].get("all_to_all_single", 0) > 0
        assert counts["alltoall"].get("reduce_scatter_single", 0) == 0


def _train(rank, world, name, native, fake=None, dev="cpu", mesh=M22, built=None):
    """Tiny under `name` (AdamW, accumulate 2): (params, ledger, max err vs reference);
    `built()` runs once the model is sharded, before training."""
    from shardc.runtime import shard_module
    data = [(x.to(dev), y.to(dev)) for x, y in batches(2, world, 2)]
    model = Tiny().to(dev)
    want, _ = reference(model, data, "adamw")
    s = strategy(name, mesh, accumulate=2)
    ctx = device.use_stream_module("cpu", fake) if fake is not None else contextlib.nullcontext()
    with device.prefer_native_reduce_scatter(native), ctx:
        sm = shard_module(copy.deepcopy(model), s, units_for(model, s.scopes))
        if built is not None:
            built()
        got, _, _ = train_sharded(sm, data, rank, world, 2, "adamw")
    return got, sm.comm_ledger(), max_rel_err(got, want)


def _ledger_native(rank, world):
    out = []
    for name in ("zero3", "hsdp_zero2", "paro_iig", "mics"):
        a, led_a, err_a = _train(rank, world, name, False)
        b, led_b, err_b = _train(rank, world, name, True)
        out.append((name, led_a == led_b and len(led_a) > 0, max_rel_err(b, a), err_a, err_b))
    return out


@pytest.mark.distributed
def test_native_path_training_parity_and_same_ledger():
    for rank_res in dist_run(4, _ledger_native, timeout=600):
        for name, same_ledger, diff, err_a, err_b in rank_res:
            assert same_ledger, f"{name}: the ledger depends on the reduce-scatter path"
            assert diff < 1e-6 and err_a < 1e-5 and err_b < 1e-5, (name, diff, err_a, err_b)


def _fake_stream_step(rank, world):
    """A training run with a fake stream module on CPU: every c10d op the runtime issues
    while training must be issued with a comm stream current, and every launch joined (the
    start-up's, which give the shards their values, run before on the default stream)."""
    import torch.distributed as dist
    fake = FakeStreams()
    seen, training = [], [False]
    saved = {}
    for op in ("all_gather_single", "reduce_scatter_single", "all_to_all_single", "all_reduce"):
        fn = saved[op] = getattr(dist, op)

        def wrapped(*a, _fn=fn, _op=op, **kw):
            if training[0]:
                seen.append((_op, fake.current_stream().name))
            return _fn(*a, **kw)
        setattr(dist, op, wrapped)
    try:
        err = 0.0
        for name in ("zero3", "hsdp_zero2"):
            training[0] = False
            err = max(err, _train(rank, world, name, False, fake=fake, built=lambda: training.__setitem__(0, True))[2])
    finally:
        for op, fn in saved.items():
            setattr(dist, op, fn)
    waits = [e for e in fake.log if e[0] == "wait_stream"]
    joins = [e for e in fake.log if e[0] == "wait_event"]
    recorded = {e[2] for e in fake.log if e[0] == "record"}
    return seen, len(waits), len(joins), all(j[1] == "default" and j[2] in recorded for j in joins), err


@pytest.mark.distributed
def test_fake_streams_every_collective_on_a_comm_stream():
    for seen, n_launch, n_join, joins_ok, err in dist_run(4, _fake_stream_step, timeout=300):
        assert err < 1e-5
        assert seen and all(stream != "default" for _, stream in seen), seen[:5]
        assert {op for op, _ in seen} >= {"all_gather_single", "all_to_all_single", "all_reduce"}
        assert n_launch > 0 and n_launch == n_join and joins_ok


# -- the GPU check script, where there is no GPU ------------------------------------------
def test_gpu_check_without_cuda_says_so(tmp_path):
    import subprocess
    import sys
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: bench/gpu_check.py would run the GPU checks (minutes)")
    for mode in ("step", "parity", "trace", "inductor"):
        r = subprocess.run([sys.executable, "bench/gpu_check.py", mode, "--out", str(tmp_path)],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "needs CUDA" in r.stderr


def test_trace_overlap_arithmetic():
    import importlib.util
    spec = importlib.util.spec_from_file_location("gpu_check", f"{ROOT}/bench/gpu_check.py")
    gc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gc)
    assert gc._union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert gc._overlap([(0, 3), (5, 8)], [(2, 6)]) == 2
    # compute stream 7 busy [0,10) and [20,30); NCCL on stream 20 [5,25): 10 of its 20 overlap
    lines = gc.summarize([(7, 0, 10, "gemm"), (7, 20, 30, "gemm"), (20, 5, 25, "ncclAllGather")])
    assert "stream 7 (compute)" in lines[0] and "stream 20 (side)" in lines[1]
    assert lines[-1].endswith("of which 0.00 ms (50%) overlapped the compute stream")
