"""compiler/passes: each pass on small hand-built graphs (node counts, order, no-op)."""
import dataclasses

import pytest
import torch.fx as fx
from torch import nn

from shardc.compiler.capture import CaptureInfo
from shardc.compiler.passes import GRAPH_PASSES, annotate_units, check, insert_collectives, run_passes, schedule_overlap
from shardc.compiler.passes.meta import Call, PassError, info
from shardc.compiler.plan import build_plan
from shardc.dsl.ir import GradsSpec, Level, Mesh, OptimSpec, ParamsSpec, Scopes, Strategy
from shardc.units import find_units

MESH = Mesh((Level("node", 2), Level("gpu", 2)))
SHARDED = Scopes(ParamsSpec(("gpu",), line=3), GradsSpec(("gpu",), line=4), OptimSpec(("node", "gpu"), line=5))


def strategy(prefetch=1, scopes=SHARDED):
    """A toy strategy; `bucket=0` keeps one unit per block (the graphs are built per block)."""
    return Strategy("toy", MESH, scopes, prefetch=prefetch, bucket=0, file="toy.shard")


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2)


def toy_graph(s, mode="fx"):
    """x -> emb -> blocks.0 -> blocks.1 -> blocks.2 -> head, built node by node."""
    model = Toy()
    g = fx.Graph()
    x = g.placeholder("x")
    for target in ("emb", "blocks.0", "blocks.1", "blocks.2", "head"):
        x = g.call_module(target, (x,))
        if mode == "export":                 # export graphs: unit from nn_module_stack
            x.meta["nn_module_stack"] = {"L__self__": ("", "Toy"), f"k_{target}": (target, "Linear")}
    g.output(x)
    gm = fx.GraphModule(model, g)
    units = find_units(model, s)
    gm.meta["shardc"] = CaptureInfo(mode, tuple(units), tuple(n for n, _ in model.named_parameters()))
    return gm, model


def kinds(gm):
    """(op, unit) of every runtime-call node, in program order."""
    return [(info(n).op.value, info(n).unit) for n in gm.graph.nodes
            if info(n) is not None and info(n).op is not Call.COMPUTE]


def test_pass_list_is_explicit_and_ordered():
    assert GRAPH_PASSES == (annotate_units, insert_collectives, schedule_overlap, check)


def test_annotate_units_marks_unit_calls():
    gm, _ = toy_graph(strategy())
    annotate_units(gm, strategy())
    got = {n.target: (info(n).unit, info(n).op) for n in gm.graph.nodes if n.op == "call_module"}
    assert got == {"emb": (0, Call.COMPUTE), "blocks.0": (1, Call.RUN_UNIT), "blocks.1": (2, Call.RUN_UNIT),
                   "blocks.2": (3, Call.RUN_UNIT), "head": (0, Call.COMPUTE)}


def test_insert_collectives_counts_and_adjacent_order():
    s = strategy(prefetch=0)
    gm, _ = toy_graph(s)
    n_before = len(gm.graph.nodes)
    insert_collectives(annotate_units(gm, s), s)
    # begin + end + (issue + wait) per sharded unit = 2 + 2*3
    assert len(gm.graph.nodes) == n_before + 8
    assert kinds(gm) == [("begin_forward", 0),
                         ("issue_gather", 1), ("wait_gather", 1), ("run_unit", 1),
                         ("issue_gather", 2), ("wait_gather", 2), ("run_unit", 2),
                         ("issue_gather", 3), ("wait_gather", 3), ("run_unit", 3), ("end_forward", 0)]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    assert info(out.args[0]).op is Call.END_FORWARD


def test_replicated_params_need_no_gathers():
    s = strategy(scopes=Scopes())                     # ddp: nothing to gather
    gm, _ = toy_graph(s)
    run_passes(gm, s)
    assert kinds(gm) == [("begin_forward", 0), ("run_unit", 1), ("run_unit", 2), ("run_unit", 3),
                         ("end_forward", 0)]


def test_schedule_overlap_prefetch_0_is_a_noop():
    s = strategy(prefetch=0)
    gm, _ = toy_graph(s)
    insert_collectives(annotate_units(gm, s), s)
    before = list(gm.graph.nodes)
    assert schedule_overlap(gm, s) is gm
    assert list(gm.graph.nodes) == before


@pytest.mark.parametrize("prefetch,expected", [
    (1, [("begin_forward", 0), ("issue_gather", 1), ("issue_gather", 2), ("wait_gather", 1), ("run_unit", 1),
         ("issue_gather", 3), ("wait_gather", 2), ("run_unit", 2), ("wait_gather", 3), ("run_unit", 3),
         ("end_forward", 0)]),
    (2, [("begin_forward", 0), ("issue_gather", 1), ("issue_gather", 2), ("issue_gather", 3),
         ("wait_gather", 1), ("run_unit", 1), ("wait_gather", 2), ("run_unit", 2), ("wait_gather", 3),
         ("run_unit", 3), ("end_forward", 0)]),
])
def test_schedule_overlap_issues_prefetch_ahead(prefetch, expected):
    s = strategy(prefetch=prefetch)
    gm, _ = toy_graph(s)
    run_passes(gm, s)
    assert kinds(gm) == expected


def test_issue_before_the_root_code_that_precedes_the_first_unit():
    s = strategy(prefetch=1)
    gm, _ = toy_graph(s)
    run_passes(gm, s)
    order = [n.target if n.op == "call_module" else info(n).op.value for n in gm.graph.nodes
             if n.op == "call_module" or (info(n) and info(n).op is not Call.COMPUTE)]
    assert order[:3] == ["begin_forward", "issue_gather", "emb"]   # gather of unit 1 overlaps emb


def test_export_regions_get_release_markers():
    s = strategy(prefetch=0)
    gm, _ = toy_graph(s, mode="export")
    run_passes(gm, s)
    assert kinds(gm) == [("begin_forward", 0),
                         ("issue_gather", 1), ("wait_gather", 1), ("release", 1),
                         ("issue_gather", 2), ("wait_gather", 2), ("release", 2),
                         ("issue_gather", 3), ("wait_gather", 3), ("release", 3), ("end_forward", 0)]


def test_check_rejects_issue_after_use():
    s = strategy(prefetch=0)
    gm, _ = toy_graph(s)
    insert_collectives(annotate_units(gm, s), s)
    issue = next(n for n in gm.graph.nodes if info(n) and info(n).op is Call.ISSUE_GATHER)
    run = next(n for n in gm.graph.nodes if info(n) and info(n).op is Call.RUN_UNIT)
    run.append(issue)                                   # issue moved after the unit ran
    with pytest.raises(PassError, match="blocks.0"):
        check(gm, s)


def test_check_rejects_param_in_no_unit_and_unreleased_gather():
    s = strategy(prefetch=0)
    gm, _ = toy_graph(s)
    units = gm.meta["shardc"].units
    gm.meta["shardc"] = dataclasses.replace(gm.meta["shardc"], units=(dataclasses.replace(units[0], params=()),) + units[1:])
    insert_collectives(annotate_units(gm, s), s)
    with pytest.raises(PassError, match="is in no unit"):
        check(gm, s)
    gm, _ = toy_graph(s, mode="export")
    insert_collectives(annotate_units(gm, s), s)
    gm.graph.erase_node(next(n for n in gm.graph.nodes if info(n) and info(n).op is Call.RELEASE))
    with pytest.raises(PassError, match="never released"):
        check(gm, s)


def test_plan_steps_and_numels():
    s = strategy(prefetch=1)
    gm, model = toy_graph(s)
    plan = build_plan(run_passes(gm, s), s, model)
    assert plan.trainable_numels == (4 * 4 + 4 + 4 * 2 + 2, 20, 20, 20)
    assert [(st.op.value, st.unit) for st in plan.steps] == kinds(gm)
    assert all(st.line == 3 for st in plan.steps if st.op in (Call.ISSUE_GATHER, Call.WAIT_GATHER))
    assert all(st.line == 4 for st in plan.steps if st.op is Call.RUN_UNIT)    # grads reduce-scatter
