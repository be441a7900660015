"""A model built on the meta device: initialized on shards, the same on every world size
(runtime/build.py, runtime/state/init.py).

- Every named strategy on 1, 2, 4 and 8 gloo ranks: `torch.manual_seed(s)` then
  `shard_module(meta_model, ..., init=fn)` gives, bit for bit, what one process's
  `torch.manual_seed(s); model.to_empty(device="cpu"); model.apply(fn)` gives (the tie
  restored, as `to_empty` breaks it) — uneven shards (width 6, hidden 7), a parameter-free
  unit, frozen parameters, a tied head, `bucket`ed units and hpZ among them;
  from there every strategy trains at parity (4 ranks, SGD+momentum and AdamW).
- The default init is each module's `reset_parameters()`; an `init` that raises names the
  module; a forward, a step, `full_state_dict()` or a `dcp.save` of `state_dict()` without
  values is one sentence, as is a
  model partly on meta, a first rank on meta beside ranks with values, and `init=` for a
  model with values.
- Values from the first rank: the others on meta receive only their own chunks (a scatter).
- The check for a parameter no init touched holds no mask of the whole parameter (start-up's
  peak is the shards and the largest unit's whole parameters, explain's `startup`).
- The init itself runs on the first rank only (runtime/state/init_first.py): the others
  call `init` on no module and draw nothing, yet end with the values and with the RNG
  where one process's `model.apply(init)` leaves it.
"""
from __future__ import annotations

import pytest
import torch

from tests.harness import dist_run
from tests.test_runtime_util import Tiny, batches, max_rel_err, reference, strategy, train_sharded, units_for

pytestmark = pytest.mark.distributed
NAMED = ["ddp", "zero1", "zero2", "zero3", "mics", "hsdp_zero2", "zeropp", "paro_igg", "paro_iig",
         "paro_nig", "lins_7b"]
MESH = {1: ("node(1) > gpu(1)", "node(1) > gpu(1) > gcd(1)"), 2: ("node(1) > gpu(2)", "node(1) > gpu(1) > gcd(2)"),
        4: ("node(2) > gpu(2)", "node(1) > gpu(2) > gcd(2)"), 8: ("node(2) > gpu(4)", "node(2) > gpu(2) > gcd(2)")}
SEED = 7


def init_fn(m):
    """reset_parameters, and the one buffer Tiny sets in its constructor (lost on meta)."""
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()
    if isinstance(m, Tiny):
        m.scale.fill_(1.5)


def meta_tiny(**kw) -> Tiny:
    with torch.device("meta"):
        return Tiny(**kw)


def one_process(**kw) -> Tiny:
    """The reference: one process's to_empty + apply(init_fn) from SEED."""
    model = meta_tiny(**kw)
    torch.manual_seed(SEED)
    model.to_empty(device="cpu")
    model.head.weight = model.emb.weight               # to_empty breaks the tie; the model has one
    model.apply(init_fn)
    return model


def _sharded(name, mesh, bucket=False, init=init_fn, **kw):
    from shardc.runtime import shard_module
    model = meta_tiny(**kw)
    s = strategy(name, mesh, accumulate=1)
    torch.manual_seed(SEED)
    return shard_module(model, s, units_for(model, s.scopes, bucket=bucket), init=init)


def _same(got: dict, want: dict) -> list[str]:
    return [k for k in want if not torch.equal(got[k], want[k])]


def _initial(rank, world):
    two, three = MESH[world]
    out = {}
    variants = {"plain": {}, "frozen": dict(frozen=True), "empty": dict(empty_unit=True)}
    if world == 8:              # 8 ranks on the suite's 2 cores: the shapes' variants run at 1, 2 and 4
        variants = {"plain": {}}
    for name in NAMED + ["zero_topo"]:
        mesh = three if name == "zero_topo" else two
        for label, kw in variants.items():
            out[name, label] = _same(_sharded(name, mesh, **kw).full_state_dict(), one_process(**kw).state_dict())
    out["bucket"] = _same(_sharded("zero3", two, bucket=True).full_state_dict(), one_process().state_dict())
    return out


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_initial_values_equal_one_process_on_every_world_size(world):
    for r in dist_run(world, _initial):
        assert all(v == [] for v in r.values()), {k: v for k, v in r.items() if v}


def _train(rank, world):
    out = {}
    for name in NAMED + ["zero_topo"]:
        mesh = MESH[world][1] if name == "zero_topo" else MESH[world][0]
        for kind in ("sgd", "adamw"):
            data = batches(2, world, 1)
            want, _ = reference(one_process(), data, kind)
            got, _, _ = train_sharded(_sharded(name, mesh), data, rank, world, 1, kind)
            out[name, kind] = max_rel_err(got, want)
    return out


def test_training_from_meta_init_is_at_parity():
    for r in dist_run(4, _train):
        assert all(err < 1e-5 for err in r.values()), r


def _errors(rank, world):
    from shardc.runtime import shard_module
    out = {}

    def said(fn):
        try:
            fn()
        except Exception as e:                       # noqa: BLE001
            return f"{type(e).__name__}: {e}"
        return "no error"

    def boom(m):
        if type(m).__name__ == "Block":
            raise ValueError("bad init")
        init_fn(m)
    out["raises"] = said(lambda: _sharded("zero3", "node(1) > gpu(2)", init=boom))
    default = _sharded("zero3", "node(1) > gpu(2)", init=None)        # each module's reset_parameters()
    x = torch.zeros(2, 5, dtype=torch.long)
    out["no_buffer"] = said(lambda: default(x))                       # Tiny's scale: no init sets it
    default.module.scale.fill_(1.5)
    want = one_process().state_dict()
    out["default"] = _same(default.full_state_dict(), want)
    empty = _sharded("zero3", "node(1) > gpu(2)", init=False)
    out["forward"] = said(lambda: empty(x))
    out["full"] = said(empty.full_state_dict)
    import tempfile
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor
    out["first_key"] = next(k for k, v in empty.state_dict().items() if isinstance(v, DTensor))   # a parameter
    with tempfile.TemporaryDirectory() as tmp:       # each rank its own: the save stops while it plans
        try:
            dcp.save(empty.state_dict(), checkpoint_id=tmp)
            out["save"] = "no error"
        except BaseException as e:                   # noqa: BLE001 — DCP's CheckpointException is one
            out["save"] = f"{type(e).__name__}: {e}"
    empty.load_state_dict(one_process().state_dict())
    out["loaded"] = _same(empty.full_state_dict(), want)
    model = Tiny()
    model.blocks[1].up.weight = torch.nn.Parameter(torch.empty(7, 6, device="meta"))
    s = strategy("zero3", "node(1) > gpu(2)")
    out["partly"] = said(lambda: shard_module(model, s, units_for(model, s.scopes)))
    mixed = meta_tiny() if rank == 0 else Tiny()
    out["first_meta"] = said(lambda: shard_module(mixed, s, units_for(mixed, s.scopes), init=init_fn))
    real = Tiny()
    out["init_real"] = said(lambda: shard_module(real, s, units_for(real, s.scopes), init=init_fn))
    return out


def test_bad_input_is_one_sentence():
    for r in dist_run(2, _errors):
        assert r["raises"].startswith("ShardcError: init function 'boom' failed on module blocks.0 (Block): "
                                      "ValueError: bad init"), r
        assert r["no_buffer"].startswith("RuntimeUsageError: a forward needs the buffers' values, but buffer "
                                         "'scale' never got one"), r
        assert r["default"] == [], r
        assert r["forward"].startswith("RuntimeUsageError: a forward needs the parameters' values, but "
                                       "'blocks.0.down.bias' and 20 more never got one"), r
        assert r["full"].startswith("RuntimeUsageError: full_state_dict() needs the parameters' values, but "
                                    "'blocks.0.down.bias' and 20 more never got one"), r
        # a sharded save: DCP's exception on every rank carries the sentence naming the piece
        assert (f"dcp.save of state_dict() needs the parameters' values, but {r['first_key']!r} never got one"
                in r["save"]), r
        assert r["loaded"] == [], r
        assert r["partly"] == ("ShardcError: parameter 'blocks.1.up.weight' is on the meta device but others have "
                               "values: build the whole model on the meta device (shardc initializes or loads "
                               "it) or the whole model with values"), r
        assert r["first_meta"].startswith("ShardcError: the mesh's first rank built the model on the meta "
                                          "device but another rank built it with values"), r
        assert r["init_real"].startswith("ShardcError: init= initializes a model built on the meta device, but "
                                         "this one has values"), r


def _scatter(rank, world):
    """The first rank has values, the others are on meta: each receives only its chunks."""
    from unittest import mock

    import torch.distributed as dist

    from shardc.runtime import shard_module
    got_elems = []
    real_scatter, real_broadcast = dist.scatter, dist.broadcast

    def scatter(t, *a, **k):
        got_elems.append(t.numel())
        return real_scatter(t, *a, **k)

    def broadcast(t, *a, **k):
        got_elems.append(t.numel())
        return real_broadcast(t, *a, **k)
    model = Tiny(seed=3) if rank == 0 else meta_tiny(seed=3)
    s = strategy("paro_iig", "node(2) > gpu(2)")
    with mock.patch.object(dist, "scatter", scatter), mock.patch.object(dist, "broadcast", broadcast):
        sm = shard_module(model, s, units_for(model, s.scopes))
    shards = sum(g.storage.shard.numel() for u in sm.runtime.units for g in u.groups)
    buffers = sum(b.numel() for b in sm.module.buffers())
    return _same(sm.full_state_dict(), Tiny(seed=3).state_dict()), sum(got_elems), shards + buffers


def test_values_from_the_first_rank_are_scattered():
    for bad, received, kept in dist_run(4, _scatter):
        assert bad == [] and received == kept, (bad, received, kept)


def _tensor_parallel(rank, world):
    """DTensor (TP) parameters built on meta: the same values as the same TP model's
    to_empty + apply, on a node(1) > gpu(2) > tp(2) world."""
    import shardc
    from torch.distributed.device_mesh import init_device_mesh

    from examples.gpt import GPT, GPTConfig, tensor_parallel
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    wm = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("node", "gpu", "tp"))

    def tp_meta():
        with torch.device("meta"):
            return tensor_parallel(GPT(cfg), wm["tp"])
    model = tp_meta()
    torch.manual_seed(SEED)
    sm = shardc.compile(model, strategy("paro_iig", "node(1) > gpu(2)"), mesh=wm["node", "gpu"],
                        example_inputs=(torch.zeros(2, 16, dtype=torch.long),), init=GPT.init_module)
    ref = tp_meta()
    torch.manual_seed(SEED)
    ref.to_empty(device="cpu")
    ref.lm_head.weight = ref.transformer.wte.weight
    ref.apply(GPT.init_module)
    want = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in ref.state_dict().items()}
    return _same(sm.full_state_dict(), want)


def test_tensor_parallel_parameters_built_on_meta():
    for bad in dist_run(4, _tensor_parallel):
        assert bad == [], bad


def test_unset_check_holds_no_whole_parameter_mask():
    # runtime/state/init.py [Note: no whole-parameter mask]: `torch.isnan(t).all()` would make a
    # bool mask of t, a quarter of its fp32 bytes, beside it at start-up's peak; in blocks the
    # check holds at most NAN_BLOCK bools, and it still tells all-NaN from a single value anywhere.
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardc.runtime.state.init import NAN_BLOCK, all_nan
    t = torch.full((4 * NAN_BLOCK,), float("nan"))          # 16 MiB of fp32: a whole mask is 4 MiB
    tracker = MemTracker()
    with tracker:
        assert all_nan(t)
    peak = tracker.get_tracker_snapshot("peak")[t.device]["Total"]
    # t itself (the tracker counts an operator's inputs), one block's mask, one-element results;
    # a whole mask would be t.numel() bytes (4 MiB) instead of NAN_BLOCK (1 MiB)
    assert peak <= t.nbytes + NAN_BLOCK + 16, peak
    for i in (0, NAN_BLOCK - 1, 4 * NAN_BLOCK - 1):
        u = t.clone()
        u[i] = 0.0
        assert not all_nan(u)


def _first_draws(rank, world):
    calls = []

    def counted(m):
        calls.append(type(m).__name__)
        init_fn(m)
    sm = _sharded("zero3", MESH[world][0], init=counted)
    after = torch.rand(4)                                  # the RNG after the init
    ref = meta_tiny()
    torch.manual_seed(SEED)
    ref.to_empty(device="cpu")
    ref.head.weight = ref.emb.weight
    ref.apply(init_fn)
    return len(calls), len(list(ref.modules())), _same(sm.full_state_dict(), ref.state_dict()), \
        torch.equal(after, torch.rand(4))


def test_only_the_first_rank_runs_the_init():
    for rank, (calls, modules, bad, rng_same) in enumerate(dist_run(4, _first_draws)):
        assert calls == (modules if rank == 0 else 0), (rank, calls, modules)
        assert bad == [] and rng_same, (rank, bad, rng_same)
