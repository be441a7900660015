"""torch's own DCP recipe loads in place (issue 54): `sd = sm.state_dict(); dcp.load(sd, ...);
sm.load_state_dict(sd)` writes the shards themselves, as FSDP2's DTensors are written.

A plain model (16 blocks, width 64) saved by one process (`dcp.save(..., no_dist=True)`) is
loaded on 4 gloo ranks into a differently initialised sharded model under ZeRO-3 (the
master is the params shard), PaRO-IIG (the master is a view of a params shard twice its
size: the load re-gathers the rest) and ZeRO-3 with bf16 params (a separate fp32 master:
the load re-makes the bf16 shard). For each:
- every piece of `sm.state_dict()` views the live shard (no clone of any piece);
- the CPU tensors allocated during state_dict + dcp.load + load_state_dict (torch's
  MemTracker, the live shards registered first) stay within explain's load staging
  (lowering/startup.py `load_staging_bytes`: two saved chunks of torch's reader, at most the
  two largest groups in fp32, or one group's re-make), which is smaller than the rank's
  pieces (what a clone of every piece, as before, cost: 4 blocks' worth here against 2);
- the values equal the saved model's bit for bit (bf16 params: the shard is the master's cast);
- one SGD step after the load equals one process on the concatenated batch (fp32 cases).
And a dcp.load that fails while DCP plans (a shape mismatch) writes nothing, as FSDP2's; one
that fails while it reads (a truncated data file) says the load failed part-way and, with
`checkpoint_errors(path, model=sm)`, leaves the parameters without values (a forward is one
sentence) until a load succeeds (runtime/state/load_errors.py [Note: nothing half-loaded]).
AdamW's state goes the same way: `opt.state_dict()`'s pieces view the live moments, and
`set_state_dict` keeps those tensors (DCP wrote them), holding the saved values.
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from tests.harness import dist_run, failure
from tests.test_runtime_util import Tiny, batches, loss_fn, strategy, units_for

pytestmark = pytest.mark.distributed
SIZE = dict(n_blocks=8, d=64, h=128)
CASES = (("zero3", "node(1) > gpu(4)", "fp32"), ("paro_iig", "node(2) > gpu(2)", "fp32"),
         ("zero3", "node(1) > gpu(4)", "bf16"))


def _strategy(name, mesh, pdtype):
    from shardc.dsl.ir import DType
    s = strategy(name, mesh, accumulate=1)
    if pdtype == "bf16":
        p = dataclasses.replace(s.scopes.params, dtype=DType.BF16, comm=DType.BF16)
        s = dataclasses.replace(s, scopes=dataclasses.replace(s.scopes, params=p))
    return s


def _recipe(rank, world, path, bad, cut, ock):
    import torch.distributed.checkpoint as dcp
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    from shardc.lowering.startup import load_staging_bytes
    from shardc.runtime import shard_module
    from shardc.runtime.state.load_errors import CheckpointError, checkpoint_errors
    out = []
    x, y = batches(1, world, 1, b=2)[0]
    for name, mesh, pdtype in CASES:
        model = Tiny(seed=5, **SIZE)
        s = _strategy(name, mesh, pdtype)
        sm = shard_module(model, s, units_for(model, s.scopes))
        live = {n: p.to_local().untyped_storage().data_ptr() for n, p in sm.named_parameters()}
        stores = [g.storage for u in sm.runtime.units for g in u.groups]
        tracker = MemTracker()
        tracker.track_external(*[t for st in stores for t in (st.shard, st.master)])    # the live shards
        cpu = torch.device("cpu")
        with tracker:
            base = tracker._curr_mem_snap[cpu][_TOTAL_KEY]
            sd = sm.state_dict()
            dcp.load(sd, checkpoint_id=path)
            sm.load_state_dict(sd)
        peak = tracker._peak_mem[cpu] - base                # (DCP's probes on "meta" hold no bytes)
        views = all(sd[n]._local_tensor.untyped_storage().data_ptr() == ptr for n, ptr in live.items())
        pieces = sum(p.to_local().numel() * 4 for p in sm.parameters())     # what a clone of every piece held
        cast = all(torch.equal(st.shard[st.os_start - st.p_start:][:st.os_len], st.master.to(st.shard.dtype))
                   for st in stores if st.master_separate)
        full = sm.full_state_dict()
        if (name, pdtype) != CASES[0][::2]:            # the failed loads: once, on the first case
            out.append(dict(case=(name, pdtype), peak=peak, bound=load_staging_bytes(sm.lowering), pieces=pieces,
                            views=views, cast=cast, full=full))
            continue
        before = {k: v.clone() for k, v in full.items()}
        refused = None
        try:                                   # a mismatched checkpoint: refused while DCP plans
            with checkpoint_errors(bad):
                dcp.load(sm.state_dict(), checkpoint_id=bad)
        except CheckpointError as e:
            refused = str(e)
        kept = all(torch.equal(v, sm.full_state_dict()[k]) for k, v in before.items())
        partway = unusable = None
        try:                                   # a truncated data file: DCP fails while reading
            with checkpoint_errors(cut, model=sm):
                dcp.load(sm.state_dict(), checkpoint_id=cut)
        except CheckpointError as e:
            partway = str(e)
            unusable = failure(lambda: sm(x.chunk(world)[rank]))
        sd = sm.state_dict()                   # a load that succeeds makes the model usable again
        dcp.load(sd, checkpoint_id=path)
        sm.load_state_dict(sd)
        opt = torch.optim.SGD(sm.parameters(), lr=0.1)
        loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        out.append(dict(case=(name, pdtype), peak=peak, bound=load_staging_bytes(sm.lowering), pieces=pieces,
                        views=views, cast=cast, full=full, refused=refused, kept=kept, partway=partway,
                        unusable=unusable,
                        stepped=sm.full_state_dict()))
    return out, _optimizer(rank, world, ock)


def _optimizer(rank, world, ock):
    """AdamW's state through the recipe: saved after one step, the run moved on one more,
    then loaded: the state tensors stay the same tensors (DCP wrote them) and hold the saved
    values again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from shardc.runtime import shard_module
    model = Tiny(seed=5, **SIZE)
    s = _strategy("zero3", "node(1) > gpu(4)", "fp32")
    sm = shard_module(model, s, units_for(model, s.scopes))
    opt = torch.optim.AdamW(sm.parameters(), lr=0.01)
    data = batches(2, world, 1, b=2)
    for x, y in data[:1]:
        loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(sm, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ock)
    want = sm.full_optim_state_dict(opt)["state"]
    for x, y in data[1:]:
        loss_fn(sm(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    ptrs = sorted(t.data_ptr() for st in opt.state.values() for t in st.values() if t.dim() > 0)
    msd, osd = get_state_dict(sm, opt)
    views = all(v._local_tensor.data_ptr() in ptrs for st in osd["state"].values()
                for v in st.values() if v.dim() > 0)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ock)
    set_state_dict(sm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    same = ptrs == sorted(t.data_ptr() for st in opt.state.values() for t in st.values() if t.dim() > 0)
    got = sm.full_optim_state_dict(opt)["state"]
    equal = all(torch.equal(got[n][k], v) for n, st in want.items() for k, v in st.items())
    return dict(views=views, same=same, equal=equal)


def test_torch_recipe_fills_the_shards_in_place(tmp_path):
    import torch.distributed.checkpoint as dcp
    plain = Tiny(seed=0, **SIZE)
    path, bad = str(tmp_path / "ckpt"), str(tmp_path / "bad")
    dcp.save(plain.state_dict(), checkpoint_id=path, no_dist=True)
    other = Tiny(seed=0, n_blocks=SIZE["n_blocks"], d=64, h=129)         # blocks' hidden width 129, not 128
    dcp.save(other.state_dict(), checkpoint_id=bad, no_dist=True)
    cut = tmp_path / "cut"
    shutil.copytree(path, cut)
    data = next(f for f in cut.iterdir() if f.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
    want = {k: v.clone() for k, v in plain.state_dict().items()}
    x, y = batches(1, 4, 1, b=2)[0]
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    loss_fn(plain(x), y).backward()
    opt.step()
    stepped = plain.state_dict()
    for rank_out, optim in dist_run(4, _recipe, path, bad, str(cut), str(tmp_path / "optim")):
        assert optim == dict(views=True, same=True, equal=True), optim
        for r in rank_out:
            case = r["case"]
            assert r["views"], case
            assert r["bound"] < r["pieces"], case     # the bound excludes a clone of the rank's pieces
            assert r["peak"] <= r["bound"], (case, r["peak"], r["bound"])
            assert r["cast"], case
            for k, v in want.items():
                assert torch.equal(r["full"][k], v), (case, k)
            if case != ("zero3", "fp32"):
                continue
            assert r["refused"] is not None and "129" in r["refused"] and "nothing was loaded" in r["refused"], case
            assert r["kept"], case
            assert r["partway"] is not None and "failed part-way" in r["partway"], (case, r["partway"])
            assert r["unusable"] is not None and "never got one" in r["unusable"], (case, r["unusable"])
            if case[1] == "fp32":
                for k, v in stepped.items():
                    torch.testing.assert_close(r["stepped"][k], v, rtol=1e-5, atol=1e-6, msg=f"{case} {k}")
