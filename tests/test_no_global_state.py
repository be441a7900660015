"""Per-model state lives with its model: two ShardedModules in one process and an unrelated
torch optimizer do not interfere (issue 53: no process-global state for what belongs to one
ShardedModule or one optimizer).

On 2 gloo ranks (node(1) > gpu(2)) a ZeRO-3 and a ZeRO-1 Tiny model (different seeds) and a
plain nn.Linear with its own torch SGD train interleaved for two steps — both backwards
before either step, the plain optimizer stepping between them with the same momentum SGD
— and each equals one process on the concatenated batch to float32 rounding. Each shardc
optimizer is adopted by its own module only; the plain optimizer by neither, and it gets
no shardc state-dict hooks. An update owed by the whole-step mode is released with its
owner, not kept by the registry the forward's graph finds it through.
"""
from __future__ import annotations

import copy
import gc

import pytest
import torch

from tests.harness import dist_run
from tests.test_runtime_util import (Tiny, batches, loss_fn, make_opt, max_rel_err, reference, strategy,
                                     units_for)

pytestmark = pytest.mark.distributed
MESH, WORLD, STEPS, TOL = "node(1) > gpu(2)", 2, 2, 1e-5


def _models():
    torch.manual_seed(3)
    a = Tiny()
    torch.manual_seed(4)
    b = Tiny()
    torch.manual_seed(5)
    return a, b, torch.nn.Linear(6, 3)


def _plain_data():
    g = torch.Generator().manual_seed(9)
    return [(torch.randn(WORLD * 2, 6, generator=g), torch.randn(WORLD * 2, 3, generator=g)) for _ in range(STEPS)]


def _train(rank, world):
    from shardc.runtime import shard_module
    from shardc.runtime.step.optimizer import _mine
    a, b, lin = _models()
    sa, sb = strategy("zero3", MESH), strategy("zero1", MESH)
    sma = shard_module(copy.deepcopy(a), sa, units_for(a, sa.scopes))
    smb = shard_module(copy.deepcopy(b), sb, units_for(b, sb.scopes))
    oa, ob = make_opt("sgd", sma), make_opt("sgd", smb)
    plain = make_opt("sgd", lin.parameters())
    for (xa, ya), (xb, yb), (xl, yl) in zip(batches(STEPS, world, 1, seed=1), batches(STEPS, world, 1, seed=2),
                                           _plain_data()):
        loss_fn(sma(xa.chunk(world)[rank]), ya.chunk(world)[rank]).backward()
        loss_fn(smb(xb.chunk(world)[rank]), yb.chunk(world)[rank]).backward()
        torch.nn.functional.mse_loss(lin(xl), yl).backward()     # every rank: the whole batch
        oa.step()
        plain.step()
        ob.step()
        for o in (oa, plain, ob):
            o.zero_grad()
    adopted = [list(sm.optimizers) for sm in (sma, smb)]
    return (sma.full_state_dict(), smb.full_state_dict(), {k: v.clone() for k, v in lin.state_dict().items()},
            adopted == [[oa], [ob]], _mine(plain) == (), len(plain._optimizer_state_dict_post_hooks))


def test_two_modules_and_a_plain_optimizer_do_not_interfere():
    a, b, lin = _models()
    want_a = reference(a, batches(STEPS, WORLD, 1, seed=1), "sgd")[0]
    want_b = reference(b, batches(STEPS, WORLD, 1, seed=2), "sgd")[0]
    lin = copy.deepcopy(lin)
    opt = make_opt("sgd", lin.parameters())
    for x, y in _plain_data():
        torch.nn.functional.mse_loss(lin(x), y).backward()
        opt.step()
        opt.zero_grad()
    for got_a, got_b, got_lin, own_only, plain_untouched, hooks in dist_run(WORLD, _train):
        assert max_rel_err(got_a, want_a) < TOL
        assert max_rel_err(got_b, want_b) < TOL
        assert all(torch.equal(got_lin[k], v) for k, v in lin.state_dict().items())
        assert own_only and plain_untouched and hooks == 0


class _Group:
    """A flat group as OwedUpdate sees it: a shard and an update all-gather (done at once)."""
    def __init__(self):
        self.storage = type("S", (), {"shard": torch.zeros(4)})()

    def update_issue(self, record, out):
        from shardc.runtime.eager.comm import DoneWork
        out.fill_(1.0)
        return DoneWork()


def test_an_owed_update_is_released_with_its_owner():
    from shardc.runtime.graph.update import _OWED, OwedUpdate, await_update, update_keys
    k1, k2 = update_keys([0, 1]).values()
    kept, dropped = OwedUpdate(_Group(), k1), OwedUpdate(_Group(), k2)
    assert {k1, k2} <= set(_OWED)
    del dropped                                    # its module went away before a forward
    gc.collect()
    assert k2 not in _OWED and k1 in _OWED
    assert torch.equal(await_update(torch.zeros(4), k1), torch.ones(4))   # the forward's graph takes it
    assert k1 not in _OWED and kept.buf is None


# -- no module-level mutable state for one model ------------------------------------------------
# Every module-level dict, list, set or weak map the library mutates, or flag it rebinds
# (`global`), and why it is process-wide rather than one model's or one optimizer's. A
# unit's record of the attributes it took lives on the module (`module._shardc_held`,
# runtime/groups/unit.py [Note: sharded modules]); a tensor-owned step on its optimizer
# (runtime/step/owned.py `step_of`). A new entry here needs a reason of the same kind.
PROCESS_WIDE = {
    ("runtime/graph/update.py", "_OWED"): "weak handles by key for the opaque op a compiled graph calls; "
                                          "each module's step boundary owns its entries",
    ("runtime/transport/mesh.py", "_CACHE"): "process groups per mesh, shared by every module on that mesh",
    ("runtime/transport/device.py", "_pools"): "one set of comm streams per device",
    ("runtime/transport/device.py", "_stream_modules"): "torch's stream module per device type",
    ("runtime/transport/device.py", "_native_rs_override"): "a process-wide switch for benchmarks and tests",
    ("runtime/step/optimizer.py", "_installed"): "torch's global optimizer hooks are installed once per process",
    ("lowering/placements.py", "_KINDS"): "placement kinds: read-only outside a test's `registered` scope",
    ("algorithms/base.py", "_REGISTRY"): "collective algorithms: read-only after import outside a test's scope",
    ("algorithms/base.py", "_SEALED"): "the registry's seal, set once at import",
    ("compiler/reuse.py", "_RECORDS"): "output shapes of the blocks export stood in for, by the int id its "
                                       "custom op carries (compile time; not any model's runtime state)",
}
PACKAGES = ("runtime", "lowering", "algorithms", "units", "compiler", "analysis", "dsl", "shardc")
CONTAINERS = {"dict", "list", "set", "defaultdict", "Counter", "OrderedDict", "WeakKeyDictionary",
              "WeakValueDictionary", "WeakSet", "deque"}
MUTATORS = {"append", "add", "setdefault", "pop", "popitem", "update", "clear", "extend", "insert", "remove",
            "discard", "appendleft"}


def _mutable_globals(tree) -> set[str]:
    import ast
    names = set()
    for node in tree.body:
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(value, ast.Call):
            f = value.func
            container = (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) in CONTAINERS
        else:
            container = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp))
        names |= {t.id for t in targets if container and isinstance(t, ast.Name)}
    return names


def _mutated(tree, names: set[str]) -> set[str]:
    """Of `names`, those the module changes: an item set or deleted, a mutating method, `global`."""
    import ast
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            out |= set(node.names)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            for t in node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]:
                if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in names:
                    out.add(t.value.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS \
                and isinstance(node.func.value, ast.Name) and node.func.value.id in names:
            out.add(node.func.value.id)
    return out


def test_no_module_level_mutable_state_but_the_process_wide():
    import ast
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    found = set()
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            tree = ast.parse(f.read_text())
            found |= {(f.relative_to(root).as_posix(), n) for n in _mutated(tree, _mutable_globals(tree))}
    assert found == set(PROCESS_WIDE), (sorted(found - set(PROCESS_WIDE)), sorted(set(PROCESS_WIDE) - found))
