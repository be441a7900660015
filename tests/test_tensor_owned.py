"""Tensor-owned optimizer states (`optim shard over LEVELS by tensor`, issue 51): the
language, the owners in the plan, and torch.optim.Muon on the matrices with AdamW on the
rest trained on gloo ranks at parity with one process on the concatenated batch."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import shardc
from shardc.dsl.unparse import unparse
from shardc.lowering.owned import assign_owners, ns_flops, owned_plan
from tests.harness import dist_run
from tests.test_runtime_util import D, H, Tiny, batches, loss_fn, max_rel_err, units_for

OWNED = """\
mesh node(2) > gpu(2)
params shard over world
grads  shard over world
optim  shard over world
accumulate 2
override "blocks.*" { optim shard over world by tensor }
"""
LR, CLIP = 0.02, 0.5


# -- the language ---------------------------------------------------------------------------
def test_by_tensor_parses_and_round_trips():
    s = shardc.load_strategy("mesh node(2) > gpu(2)\nparams shard over gpu\ngrads shard over world\n"
                             "optim shard over world by tensor\n")
    assert s.optim.owned and s.optim.levels == ("node", "gpu") and s.grads.levels == ("node", "gpu")
    assert "optim  shard over world by tensor" in unparse(s)
    again = shardc.load_strategy(unparse(s)).optim
    assert (again.levels, again.granularity) == (s.optim.levels, s.optim.granularity)
    o = shardc.load_strategy(OWNED)
    assert not o.optim.owned and o.overrides[0].optim.owned


def test_by_tensor_keeps_the_dependency_rule_located():
    with pytest.raises(shardc.ShardcError) as e:
        shardc.load_strategy("mesh node(2) > gpu(2)\nparams shard over world\ngrads shard over world\n"
                             "optim shard over gpu by tensor\n")
    assert "<string>:" in str(e.value) and "node" in str(e.value)


# -- the owners -----------------------------------------------------------------------------
def test_owners_balance_newton_schulz_cost():
    # LPT over costs 8, 7, 6, 5, 4 on 2 owners: 8 -> 0, 7 -> 1, 6 -> 1 (7 < 8), 5 -> 0 (8 < 13),
    # 4 -> 0 (13 = 13: the lowest position)
    assert assign_owners([8, 7, 6, 5, 4], 2) == [0, 1, 1, 0, 0]
    # one iteration of torch.optim.Muon's Newton–Schulz, m = 128 <= n = 512: 4m²n + 2m³
    assert ns_flops((512, 128)) == ns_flops((128, 512)) == 4 * 128 * 128 * 512 + 2 * 128 ** 3


def _best_max_load(costs, ranks):
    """The smallest possible most-loaded owner (exhaustive, owners of equal load tried once)."""
    best = [sum(costs)]

    def place(i, load):
        if max(load) >= best[0]:
            return
        if i == len(costs):
            best[0] = max(load)
            return
        for r in sorted(set(range(ranks)), key=lambda r: load[r]):
            if load[r] in load[:r]:
                continue
            load[r] += costs[i]
            place(i + 1, load)
            load[r] -= costs[i]
    place(0, [0] * ranks)
    return best[0]


def test_bench_gpt_owners_are_the_optimum():
    """The bench GPT's 16 block matrices (bench/models.py `bench`, d = 512): at 4 owners each
    holds the mean; at 8 the greedy assignment's most-loaded owner is the optimum, 16/14 of
    the mean in units of 2·512³ FLOPs (eight 512×2048 at 9, four 512×1536 at 7, four 512×512
    at 3: every owner needs one 9, so four carry 9 + 7)."""
    shapes = [(1536, 512), (512, 512), (2048, 512), (512, 2048)] * 4
    costs = sorted((ns_flops(s) for s in shapes), reverse=True)
    unit = 2 * 512 ** 3
    assert sorted({c // unit for c in costs}) == [3, 7, 9]
    for ranks, worst in ((4, 28), (8, 16)):
        load = [0] * ranks
        for c, r in zip(costs, assign_owners(costs, ranks)):
            load[r] += c
        assert max(load) == worst * unit == _best_max_load(costs, ranks)
        assert max(load) / (sum(load) / ranks) - 1 == pytest.approx({4: 0.0, 8: 1 / 7}[ranks])


def _units(model, strategy):
    from shardc.lowering import unit_scopes
    return [dataclasses.replace(u, scopes=unit_scopes(strategy, u.name, u.modules)[0])
            for u in units_for(model, strategy.scopes)]


def test_plan_owns_the_blocks_matrices_only():
    s = shardc.load_strategy(OWNED)
    model = Tiny()
    units = _units(model, s)
    named = dict(model.named_parameters())
    plan = owned_plan(s.mesh, units, {n: p.shape for n, p in named.items()},
                      {n: p.requires_grad for n, p in named.items()})
    g, rest = plan.groups
    assert g.levels == ("node", "gpu") and g.ranks == 4 and g.matrices
    assert [t.name for t in g.tensors] == [f"blocks.{i}.{m}.weight" for i in range(3) for m in ("up", "down")]
    # six matrices of equal cost over 4 owners: two owners get two
    one = 4 * min(D, H) ** 2 * max(D, H) + 2 * min(D, H) ** 3
    assert sorted(g.load()) == [one] * 2 + [2 * one] * 2
    elems = 6 * D * H
    # a rank's mean share (the links model's all-to-all buffer): fp32 param + grad, then param
    assert [r.bytes for r in g.rows] == [2 * 4 * elems // 4, 4 * elems // 4]
    # the blocks' norms and biases: owned whole too, balanced by elements (nine of D = 6 and
    # three of H = 7 over 4 owners: the 7s first, one each to owners 0-2, then the 6s to the
    # least loaded: 19, 19, 19, 18)
    assert not rest.matrices and rest.levels == g.levels
    assert sorted(t.name for t in rest.tensors) == sorted(
        f"blocks.{i}.{n}" for i in range(3) for n in ("ln.weight", "ln.bias", "up.bias", "down.bias"))
    assert rest.load() == (19, 19, 19, 18) and sum(rest.load()) == 3 * (3 * D + H)
    assert [r.bytes for r in rest.rows] == [2 * 4 * 75 // 4, 4 * 75 // 4]


def _bench_gpt():
    """bench/models.py's `bench` preset (4 blocks of d = 512), on the meta device."""
    import os
    from shardc.cli.loader import load_factory
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with torch.device("meta"):
        return load_factory(os.path.join(root, "examples/gpt.py") + ":gpt")(
            vocab_size=256, block_size=64, n_layer=4, n_head=8, n_embd=512)


def test_bench_gpt_model_states_equal_the_full_tensor_recipes_on_every_rank():
    """The bench's layout (zero3, the blocks' optimizer states by tensor, Muon on the blocks'
    matrices and AdamW on the rest) at the bench's 4 ranks: every rank's model states
    (explain's, which tests above hold equal to `memory_report()`) equal those of FSDP2 with
    the `full_tensor()` recipe, a quarter of every tensor per rank: params and grads 4 B per
    element, Muon's momentum 4 B per element of the blocks' matrices, AdamW 8 B per element
    of the rest, all from the parameters' shapes. Before the blocks' norms and biases were
    owned whole (balanced by elements) they sat in the flat chunks and the largest rank
    held 24,576 B more."""
    from shardc.analysis.costmodel.memory import memory_of, optimizer_state_bytes
    from shardc.analysis.costmodel.owned import optim_bytes_per_rank, owned_of
    from shardc.analysis.costmodel.report import model_units
    from shardc.lowering import lower
    world = 4
    s = shardc.load_strategy("mesh node(2) > gpu(2)\nparams shard over world\ngrads  shard over world\n"
                             "optim  shard over world\n"
                             'override "transformer.h.*" { optim shard over world by tensor }\n')
    model = _bench_gpt()
    named = list(model.named_parameters())
    assert all(p.shape[0] % world == 0 for _, p in named)      # FSDP2's dim-0 shards: no padding

    def muon(n, p):
        return n.startswith("transformer.h.") and p.dim() == 2
    recipe = sum(p.numel() // world * (4 + 4 + (4 if muon(n, p) else 8)) for n, p in named)
    units = model_units(s, model)
    plan = lower(s.mesh, units, s.prefetch)
    owned = owned_of(s, model)
    mats, rest = owned.plan.groups
    # the owners explain prints: Newton–Schulz FLOPs even (one matrix of each kind per owner),
    # and the blocks' 28 norm and bias vectors (24 of 512, 4 of 2,048) at 5,120 elements each
    assert mats.imbalance() == 0.0 and rest.load() == (5120,) * world
    optim = optim_bytes_per_rank(s, plan, owned, k_flat=optimizer_state_bytes("adamw"),
                                 k_owned=optimizer_state_bytes("muon"))
    states = memory_of(plan, k_state=optimizer_state_bytes("adamw"), prefetch=s.prefetch)
    total = sum(p.numel() for _, p in named)
    assert states["params"] == states["grads"] == 4 * total // world
    per_rank = [states["params"] + states["params_secondary"] + states["grads"] + o for o in optim]
    assert per_rank == [recipe] * world, (per_rank, recipe)


# -- parity ----------------------------------------------------------------------------------
def _split(named):
    muon = [p for n, p in named if n.startswith("blocks.") and p.dim() == 2]
    rest = [p for n, p in named if not (n.startswith("blocks.") and p.dim() == 2)]
    return muon, rest


def _opts(named):
    muon, rest = _split(named)
    return (torch.optim.Muon(muon, lr=LR, weight_decay=0.1),
            torch.optim.AdamW(rest, lr=0.01, weight_decay=0.1))


def _reference(model, data):
    model = copy.deepcopy(model)
    opts = _opts(list(model.named_parameters()))
    for x, y in data:
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


def _train(rank, world, texts, acc=2, steps=2):
    from shardc.runtime import shard_module
    out = []
    for text in texts:
        s = shardc.load_strategy(text)
        data = batches(steps, world, acc)
        model = Tiny()
        want = _reference(model, data)
        sm = shard_module(copy.deepcopy(model), s, _units(model, s))
        opts = _opts(list(sm.named_parameters()))
        for k, (x, y) in enumerate(data):
            if k == len(data) - 1:
                sm.reset_comm_ledger()                # the last step's ledger, against explain's
            xs, ys = x.chunk(world)[rank].chunk(acc), y.chunk(world)[rank].chunk(acc)
            for m in range(acc):
                (loss_fn(sm(xs[m]), ys[m]) / acc).backward()
            sm.clip_grad_norm_(CLIP)
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad()
        owned = sum(v["momentum_buffer"].numel() for v in opts[0].state.values())
        saved = opts[0].state_dict()["state"]        # as chunks (tests/test_owned_checkpoint.py)
        assert len(saved) == 6 and all("momentum_buffer" in v for v in saved.values())
        ledger = [(r.phase, r.op, tuple(r.levels), r.bytes, r.count) for r in sm.comm_ledger()]
        out.append((max_rel_err(sm.full_state_dict(), want), owned, ledger, sm.memory_report()))
    return out


def _explained(text):
    """explain's ledger of one step (2 micro-batches, clipping) and every rank's model-state
    bytes (params, secondary params, grads, optimizer states) for Tiny under `text`, on the
    units the runs use."""
    from shardc.analysis.costmodel import predict_ledger
    from shardc.analysis.costmodel.memory import memory_of, optimizer_state_bytes
    from shardc.analysis.costmodel.owned import Owned, optim_bytes_per_rank, with_owned_rows
    from shardc.analysis.costmodel.sizes import model_unit_sizes
    from shardc.lowering import lower
    s = shardc.load_strategy(text)
    model = Tiny()
    units = _units(model, s)
    sizes = model_unit_sizes(model, units)
    named = dict(model.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in named.items()}
    trainable = {n: p.requires_grad for n, p in named.items()}
    owned = Owned(owned_plan(s.mesh, units, shapes, trainable), tuple(units), shapes, trainable)
    ledger = [(r.phase, r.op, tuple(r.levels), r.bytes, r.count)
              for r in with_owned_rows(predict_ledger(s, sizes, micro_batches=2, clip_grad_norm=True), owned)]
    plan = lower(s.mesh, sizes, s.prefetch)
    optim = optim_bytes_per_rank(s, plan, owned, k_flat=optimizer_state_bytes("adamw"),
                                 k_owned=optimizer_state_bytes("muon"))
    states = memory_of(plan, k_state=optimizer_state_bytes("adamw"), prefetch=s.prefetch)
    return ledger, [dict(params=states["params"], params_secondary=states["params_secondary"],
                         grads=states["grads"], optim=o) for o in optim]


def _layout(mesh, params, grads, optim):
    return (f"mesh {mesh}\nparams {params}\ngrads  {grads}\noptim  {optim}\naccumulate 2\n"
            f'override "blocks.*" {{ optim {optim} by tensor }}\n')


FOUR = "node(2) > gpu(2)"
LAYOUTS = {
    "zero3": (OWNED,),
    # PaRO-IIG: params and grads over gpu, the matrices' owners over the world
    "paro_iig": (_layout(FOUR, "shard over gpu", "shard over gpu", "shard over world"),),
    # owners over gpu, replicated over node (each node's ranks own every matrix once)
    "owners_gpu": (_layout(FOUR, "shard over gpu", "shard over gpu", "shard over gpu"),),
    # hpZ: a secondary params shard over gpu
    "hpz": (_layout(FOUR, "shard over world secondary gpu", "shard over world", "shard over world"),),
    # DDP: every piece is whole, so Muon steps views of them, every rank every matrix
    "replicate": (f"mesh {FOUR}\nparams replicate\ngrads  replicate\noptim  replicate\naccumulate 2\n",),
}


def _check(results, copies, texts=()):
    for rank_res in results:
        for err, *_ in rank_res:
            assert err < 1e-5, results
    # the ledger and every rank's model states equal explain's
    for k, text in enumerate(texts):
        if text is None:                      # no tensor-owned scope
            continue
        ledger, memory = _explained(text)
        assert any(op == "all_to_all" for _, op, *_ in ledger)
        for rank, res in enumerate(results):
            assert res[k][2] == ledger, (k, rank)
            got = {key: res[k][3][key] for key in memory[rank]}
            assert got == memory[rank], (k, rank, memory)
    # each matrix's momentum lives whole on one rank of each owner group (`copies` groups)
    for k in range(len(results[0])):
        assert sum(r[k][1] for r in results) == copies[k] * 6 * D * H


def test_muon_adamw_parity_by_tensor_4_ranks():
    names = list(LAYOUTS)
    texts = [LAYOUTS[n][0] for n in names]
    _check(dist_run(4, _train, texts), [{"owners_gpu": 2, "replicate": 4}.get(n, 1) for n in names],
           [None if n == "replicate" else t for n, t in zip(names, texts)])


def test_muon_adamw_parity_by_tensor_8_ranks():
    """zero3, PaRO-IIG and hpZ at 8 ranks, with the ledger and optimizer states explain's."""
    eight = "node(2) > gpu(4)"
    texts = [_layout(eight, "shard over world", "shard over world", "shard over world"),
             _layout(eight, "shard over gpu", "shard over gpu", "shard over world"),
             _layout(eight, "shard over world secondary gpu", "shard over world", "shard over world")]
    _check(dist_run(8, _train, texts), [1] * len(texts), texts)


# -- the ledger and the memory equal explain's -------------------------------------------------
LLAMA_OWNED = """\
mesh node(2) > gpu(2)
params shard over world
grads  shard over world
optim  shard over world
accumulate 2
override "layers.*" { optim shard over world by tensor }
"""


def _llama():
    import os
    from shardc.cli.loader import load_factory
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    torch.manual_seed(0)
    return load_factory(os.path.join(root, "examples/llama.py") + ":llama_tiny")()


def _llama_opts(named):
    muon = [p for n, p in named if n.startswith("layers.") and p.dim() == 2]
    rest = [p for n, p in named if not (n.startswith("layers.") and p.dim() == 2)]
    return torch.optim.Muon(muon, lr=LR), torch.optim.AdamW(rest, lr=1e-3)


LLAMA_IIG = LLAMA_OWNED.replace("params shard over world", "params shard over gpu").replace(
    "grads  shard over world", "grads  shard over gpu")


def _measure(rank, world, texts):
    return [_measure_one(rank, world, t) for t in texts]


def _measure_one(rank, world, text):
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.runtime import shard_module
    from shardc.units import find_units
    s = shardc.load_strategy(text)
    model = _llama()
    sm = shard_module(model, s, find_units(model, resolve_bucket(model, s)))
    opts = _llama_opts(list(sm.named_parameters()))
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x = torch.randint(0, 101, (2, 8), generator=g)
        (sm(x).float().pow(2).mean() / 2).backward()
    sm.clip_grad_norm_(1.0)
    for o in opts:
        o.step()
    for o in opts:
        o.zero_grad()
    ledger = [(r.phase, r.op, tuple(r.levels), r.bytes, r.count) for r in sm.comm_ledger()]
    return ledger, sm.memory_report()["optim"]


def _predict(text):
    from shardc.analysis.costmodel import predict_ledger
    from shardc.analysis.costmodel.memory import optimizer_state_bytes
    from shardc.analysis.costmodel.owned import optim_bytes_per_rank, owned_of, with_owned_rows
    from shardc.analysis.costmodel.report import model_units
    from shardc.lowering import lower
    s = shardc.load_strategy(text)
    model = _llama()
    units = model_units(s, model)
    owned = owned_of(s, model)
    ledger = [(r.phase, r.op, tuple(r.levels), r.bytes, r.count)
              for r in with_owned_rows(predict_ledger(s, units, micro_batches=2, clip_grad_norm=True), owned)]
    optim = optim_bytes_per_rank(s, lower(s.mesh, units, s.prefetch), owned,
                                 k_flat=optimizer_state_bytes("adamw"), k_owned=optimizer_state_bytes("muon"))
    return ledger, optim


LLAMA_HPZ = LLAMA_OWNED.replace("params shard over world", "params shard over world secondary gpu")


def test_ledger_and_optim_memory_equal_explains():
    """zero3, PaRO-IIG and hpZ with Muon and AdamW, two optimizers stepped one after the
    other: the ledger (one update all-gather per step, after the second optimizer:
    runtime/step/boundary.py [Note: one step, several optimizers]) and every rank's optimizer states."""
    texts = [LLAMA_OWNED, LLAMA_IIG, LLAMA_HPZ]
    measured = dist_run(4, _measure, texts)
    for k, text in enumerate(texts):
        ledger, optim = _predict(text)
        assert any(op == "all_to_all" for _, op, *_ in ledger)
        if text is LLAMA_IIG:                   # PaRO-IIG gathers the update over node after the step
            assert any(ph == "update" and op == "all_gather" for ph, op, *_ in ledger), ledger
        for rank, res in enumerate(measured):
            got_ledger, got_optim = res[k]
            assert got_ledger == ledger, (k, rank)
            assert got_optim == optim[rank], (k, rank, optim)
        assert len(set(optim)) > 1          # the owners' whole states differ per rank


def test_explain_prints_the_owners_and_their_rows(tmp_path, capsys):
    from shardc.cli import main
    path = tmp_path / "owned.shard"
    path.write_text(LLAMA_OWNED)
    assert main(["explain", str(path), "--model", "examples/llama.py:llama_tiny", "--clip", "--no-graph"]) == 0
    out = capsys.readouterr().out
    # llama_tiny's 2 blocks hold 7 matrices each (wq, wk, wv, wo, w1, w2, w3), over 4 owners
    assert "tensor owners over node, gpu (14 matrices, 4 owners" in out
    assert sum(f"  owner {r}: " in out for r in range(4)) == 4
    assert "all_to_all" in out
    # --json: the owner of each matrix and each owner's share, as the plan assigned them
    import json
    assert main(["explain", str(path), "--model", "examples/llama.py:llama_tiny", "--clip", "--no-graph",
                 "--json"]) == 0
    g, rest = json.loads(capsys.readouterr().out)["owners"]
    named = dict(_llama().named_parameters())
    assert g["levels"] == ["node", "gpu"] and g["owners"] == 4 and len(g["tensors"]) == 14
    assert g["kind"] == "matrices" and rest["kind"] == "elementwise"
    # the blocks' 4 RMSNorm weights, owned whole and balanced by elements: one each
    norms = [n for n in named if n.startswith("layers.") and named[n].dim() == 1]
    assert sorted(t["name"] for t in rest["tensors"]) == sorted(norms) and len(norms) == 4
    assert [o["elements"] for o in rest["per_owner"]] == [named[norms[0]].numel()] * 4
    for t in g["tensors"]:
        assert t["flops"] == ns_flops(named[t["name"]].shape) and 0 <= t["owner"] < 4
    load = [sum(t["flops"] for t in g["tensors"] if t["owner"] == r) for r in range(4)]
    assert [o["flops"] for o in g["per_owner"]] == load
    assert sum(o["share"] for o in g["per_owner"]) == pytest.approx(1.0)
    assert g["imbalance"] == pytest.approx(max(load) / (sum(load) / 4) - 1)
    assert sum(o["elements"] for o in g["per_owner"]) == sum(named[t["name"]].numel() for t in g["tensors"])


def test_plan_places_the_matrices_states_by_tensor(tmp_path, capsys):
    """`shardc plan --matrices GLOB`: every candidate whose optim scope is sharded steps
    those units' matrices whole on owners over its optim levels (the rest element-wise);
    the best one is written with that override and loads."""
    import json
    from shardc.cli import main
    out = tmp_path / "best.shard"
    assert main(["plan", "--model", "examples/llama.py:llama_tiny", "--mesh", "node(2) > gpu(2)",
                 "--memory", "1GiB", "--micro-batches", "2", "--tokens", "16", "--top", "16",
                 "--matrices", "layers.*", "--overhead", "0", "--json", "-o", str(out)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["fit"] == 16
    for r in doc["ranking"]:
        assert r["optim_by_tensor"] == ("layers.*" if r["optim"] else None), r
    s = shardc.load_strategy(str(out))
    best = doc["ranking"][0]
    if best["optim"]:
        (ov,) = s.overrides
        assert ov.pattern == "layers.*" and ov.optim.owned and list(ov.optim.levels) == best["optim"]


# -- refusals -------------------------------------------------------------------------------------
def _refusals(rank, world):
    from shardc.runtime import shard_module
    out = {}
    flat = shardc.load_strategy(OWNED.replace(' by tensor', ''))
    model = Tiny()
    sm = shard_module(copy.deepcopy(model), flat, _units(model, flat))
    muon, _ = _split(list(sm.named_parameters()))
    try:
        torch.optim.Muon(muon, lr=LR).step()
    except shardc.ShardcError as e:
        out["flat"] = str(e)
    s = shardc.load_strategy(OWNED)
    try:
        shard_module(copy.deepcopy(model), s, _units(model, s), backend="inductor")
    except shardc.ShardcError as e:
        out["inductor"] = str(e)
    return out


def test_refusals_name_the_tensor_owned_scope():
    got = dist_run(4, _refusals)[0]
    assert "Muon is not an element-wise optimizer" in got["flat"]
    assert "'blocks.0.up.weight' is a flat chunk over node, gpu" in got["flat"]
    assert "`optim shard over LEVELS by tensor`" in got["flat"] and "\n" not in got["flat"]
    assert "backend='inductor'" in got["inductor"] and "by tensor" in got["inductor"]


def test_newton_schulz_flops_follow_muons_iterations():
    from shardc.analysis.costmodel.owned import NS_STEPS, ns_step_flops
    # a 4x6 matrix (m = 4 <= n = 6): X·Xᵀ 2·4·4·6, A·A 2·4³, B·X 2·4·4·6, per iteration
    assert ns_step_flops((6, 4)) == ns_step_flops((4, 6)) == NS_STEPS * (2 * 96 + 2 * 64 + 2 * 96)
