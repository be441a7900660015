"""A collective algorithm is one object (shardc.algorithms): adding one is one file.

`tests/algo_outer_first.py` defines `outer-first` (the hierarchical stages, outermost level
first for a reduce-scatter), registered for each test's scope (`registered`: the registry is
read-only after import, and outside the scope `outer-first` is unknown again, so it is no
`auto` candidate for the rest of the process). With nothing else changed: a strategy names it and `shardc
check` reads it; `explain` counts its bytes per link level as its stages move them (written
out below from the stage volumes); both executors run it — the eager runtime's collectives
and the whole-step mode's functional ones (run eagerly here, without compiling) give every
all-gather, reduce-scatter and all-reduce of every digit order as the definition says — and
the eager runtime trains a GPT with it at parity with one process, its ledger explain's.
"""
from __future__ import annotations

from dataclasses import astuple

import pytest
import torch

from shardc.algorithms import names, register, registered
from tests.algo_outer_first import OuterFirst
from tests.harness import dist_run

pytestmark = pytest.mark.distributed
TEXT = ("mesh node(2) > gpu(2)\nparams shard over world\ngrads shard over world\noptim shard over world\n"
        "collectives outer-first\n")


@pytest.fixture
def outer_first():
    with registered(OuterFirst):
        yield
    assert "outer-first" not in names()


def test_the_registry_is_read_only_and_a_scoped_algorithm_leaves_with_its_scope():
    import shardc
    with pytest.raises(RuntimeError, match="read-only after import"):
        register(OuterFirst)
    with registered(OuterFirst):
        assert names()[-1] == "outer-first"
    assert "outer-first" not in names()
    with pytest.raises(shardc.ShardcError, match="unknown collectives algorithm `outer-first`"):
        shardc.load_strategy(TEXT)


def test_a_new_algorithm_is_read_by_the_dsl_and_the_cost_model(outer_first):
    import shardc
    from shardc.analysis.costmodel.links import record_links
    from shardc.lowering import Op
    s = shardc.load_strategy(TEXT)
    assert str(s.collectives) == "outer-first"
    V = 1024.0
    # reduce-scatter, node first: node moves (2-1)/2·V, then gpu (2-1)/2 of the remaining V/2
    assert record_links(Op.REDUCE_SCATTER, ("node", "gpu"), V, s.mesh, s.collectives) == {"node": V / 2, "gpu": V / 4}
    # all-gather, gpu first: gpu's stage outputs V/2 (moves half of it), node's outputs V
    assert record_links(Op.ALL_GATHER, ("node", "gpu"), V, s.mesh, s.collectives) == {"gpu": V / 4, "node": V / 2}
    # the hierarchical order is the other way round
    assert record_links(Op.REDUCE_SCATTER, ("node", "gpu"), V, s.mesh, "hierarchical") == {"gpu": V / 2, "node": V / 4}
    with pytest.raises(shardc.ShardcError, match="unknown collectives algorithm `outer-frist`"):
        shardc.load_strategy(TEXT.replace("outer-first", "outer-frist"))


def _train(rank, world, backend):
    with registered(OuterFirst):
        return _train_in_scope(rank, world, backend)


def _train_in_scope(rank, world, backend):
    import shardc
    from examples.gpt import GPT, GPTConfig
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    sm = shardc.compile(GPT(cfg), TEXT + "bucket 0\n", backend=backend,
                        example_inputs=(torch.zeros(2, 16, dtype=torch.long),))
    opt = sm.optimizer(torch.optim.AdamW, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (8, 17), generator=g)
    xs = x.chunk(world)[rank]
    sm.reset_comm_ledger()
    torch.nn.functional.cross_entropy(sm(xs[:, :-1]).flatten(0, 1), xs[:, 1:].flatten()).backward()
    opt.step()
    from shardc.analysis.costmodel.ledger import ledger_of
    return ({k: v.clone() for k, v in sm.full_state_dict().items()}, sm.comm_ledger(),
            ledger_of(sm.lowering, forwards=1, backwards=1))


def _executors(rank, world):
    with registered(OuterFirst):
        return _executors_in_scope(rank, world)


def _executors_in_scope(rank, world):
    from shardc.dsl.ir import Collectives, DType, Level, Mesh
    from shardc.lowering import Op, Per, Phase, Row
    from shardc.runtime.eager import collectives as C
    from shardc.runtime.graph.funcol import FunctionalComm
    from shardc.runtime.transport.mesh import ShardMesh
    from tests.test_collectives import cases, data, members, references
    mesh = Mesh((Level("node", 2), Level("gpu", 2)))
    algo, sm, m, bad = Collectives("outer-first"), ShardMesh(mesh), 6, []
    rows = [Row(Phase.FORWARD, Op.ALL_GATHER, mesh.ordered(lv), order, 0, Per.FORWARD, DType.FP32)
            for lv, order in cases(mesh)]
    fc = FunctionalComm(sm, algo, rows)
    for case, ((levels, order), row) in enumerate(zip(cases(mesh), rows)):
        grp = members(mesh, rank, order)
        s, me = len(grp), grp.index(rank)
        ag, full, rs, ar = references(grp, me, case, m)
        out = torch.empty(s * m)
        C.all_gather(out, data(rank, case, m), sm, levels, order, algo=algo).wait()
        got = torch.empty(m)
        C.reduce_scatter(got, full[me], sm, levels, order, algo=algo).wait()
        t = data(rank, case, 2 * m + 1)
        C.all_reduce(t, sm, levels, algo=algo).wait()
        for name, eager, functional, want in (
                ("all_gather", out, fc.all_gather(row, data(rank, case, m)), ag),
                ("reduce_scatter", got, fc.reduce_scatter(row, full[me]), rs),
                ("all_reduce", t, fc.all_reduce(row, data(rank, case, 2 * m + 1)), ar)):
            for executor, value in (("eager", eager), ("functional", functional)):
                if not torch.allclose(value, want, rtol=1e-5, atol=1e-6):
                    bad.append((executor, name, levels, order))
    return bad


def test_both_executors_place_chunks_by_the_definition():
    for bad in dist_run(4, _executors):
        assert bad == [], bad


def test_the_eager_runtime_trains_with_it_at_parity():
    backend = "eager"
    from examples.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (8, 17), generator=g)
    torch.nn.functional.cross_entropy(ref(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
    opt.step()
    want = ref.state_dict()
    for got, ledger, predicted in dist_run(4, _train, backend):
        for k, v in want.items():
            assert float((got[k] - v).norm() / v.norm()) < 1e-5, k
        assert sorted(map(astuple, ledger)) == sorted(map(astuple, predicted))


def _shared_paths(rank, world):
    """The whole-step mode's all-reduce runs the algorithm's pieces (one all-reduce over the
    reduce group per piece), and its qgZ and gloo reduce-scatters equal the eager runtime's
    to the bit (one implementation of their local halves, runtime/transport/a2a.py)."""
    from shardc.dsl.ir import Collectives, DType, Level, Mesh
    from shardc.lowering import Op, Per, Phase, Row
    from shardc.runtime.eager import collectives as C
    from shardc.runtime.graph import funcol
    from shardc.runtime.transport.mesh import ShardMesh
    mesh = Mesh((Level("node", 2), Level("gpu", 2)))
    sm, n, out = ShardMesh(mesh), 4 * 37, {}
    g = torch.Generator().manual_seed(rank)
    t, full = torch.randn(2 * n + 1, generator=g), torch.randn(n, generator=g)
    for algo in (Collectives.HIERARCHICAL, Collectives.HO_RING):
        row = Row(Phase.SYNC, Op.ALL_REDUCE, mesh.names, mesh.names, 0, Per.STEP, DType.FP32)
        fcomm, calls, real = funcol.FunctionalComm(sm, algo, [row]), [], funcol.fc.all_reduce
        funcol.fc.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            got = fcomm.all_reduce(row, t.clone())
        finally:
            funcol.fc.all_reduce = real
        want = t.clone()
        C.all_reduce(want, sm, mesh.names, algo=algo).wait()
        out[f"all_reduce {algo}"] = (len(calls), torch.equal(got, want))
        for comm in (DType.FP32, DType.INT8):
            rs = Row(Phase.BACKWARD, Op.REDUCE_SCATTER, mesh.names, mesh.names, 0, Per.BACKWARD, comm)
            eager = torch.empty(n // 4)
            C.reduce_scatter(eager, full, sm, mesh.names, algo=algo, comm=comm).wait()
            functional = funcol.FunctionalComm(sm, algo, [rs]).reduce_scatter(rs, full.clone())
            out[f"reduce_scatter {algo} {comm.name}"] = torch.equal(functional, eager)
    return out


def test_both_executors_share_the_all_reduce_pieces_and_the_reduce_scatters():
    from shardc.algorithms import get
    pieces = {"hierarchical": get("hierarchical").pieces, "ho-ring": get("ho-ring").pieces}
    assert pieces["ho-ring"] > 1
    for got in dist_run(4, _shared_paths):
        for name, p in pieces.items():
            assert got[f"all_reduce {name}"] == (p, True), name
            assert got[f"reduce_scatter {name} FP32"] and got[f"reduce_scatter {name} INT8"], name
