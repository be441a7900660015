"""compiler/capture: fx and export capture, unit order, and located failures (no tracebacks)."""
import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from shardc.compiler.capture import capture
from shardc.dsl.errors import ShardcError
from shardc.dsl.ir import GradsSpec, Level, Mesh, OptimSpec, ParamsSpec, Scopes, Strategy, UnitsKind, UnitsSpec
from shardc.units import find_units
from examples.gpt import example_inputs, tiny
from tests.harness import HANG_S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = Strategy("t", Mesh((Level("gpu", 2),)), Scopes(ParamsSpec(("gpu",), line=2), GradsSpec(("gpu",), line=3),
                                                  OptimSpec(("gpu",), line=4)),
             bucket=0, file="t.shard")          # bucket 0: one unit per module (the finder needs a size)


def test_fx_units_are_leaf_calls():
    m = tiny()
    gm = capture(m, find_units(m, S), mode="fx")
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert calls == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                     "transformer.ln_f", "lm_head"]
    assert gm.meta["shardc"].mode == "fx"
    assert ("lm_head.weight", "transformer.wte.weight") in gm.meta["shardc"].aliases


def test_export_units_from_module_stack():
    m = tiny()
    gm = capture(m, find_units(m, S), example_inputs(m), mode="export")
    info = gm.meta["shardc"]
    assert info.mode == "export" and [u.name for u in info.units] == ["<root>", "transformer.h.0", "transformer.h.1"]


class Reversed(nn.Module):
    """Blocks registered 0, 1, 2 but run 2, 1, 0: capture puts units in run order."""
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(3, 3) for _ in range(3))

    def forward(self, x):
        for b in reversed(self.blocks):
            x = b(x)
        return x


@pytest.mark.parametrize("mode", ["fx", "export"])
def test_units_reordered_into_execution_order(mode):
    m = Reversed()
    units = find_units(m, S)
    assert [u.name for u in units] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    gm = capture(m, units, (torch.ones(1, 3),), mode=mode)
    assert [u.name for u in gm.meta["shardc"].units] == ["<root>", "blocks.2", "blocks.1", "blocks.0"]


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(2, 2)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.pre(x))


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        if x.sum() > 0:                      # data-dependent control flow
            return self.lin(x)
        return x


def test_fx_failure_is_located():
    m = Branchy()
    with pytest.raises(ShardcError) as e:
        capture(m, find_units(m, S), mode="fx")
    msg = str(e.value)
    assert "capture fx stopped in module 'gate'" in msg
    assert f"test_capture.py:{Gate.forward.__code__.co_firstlineno + 1}" in msg and "if x.sum() > 0:" in msg
    assert "capture export" in msg and "units" in msg and "Traceback" not in msg


def test_export_failure_is_located_and_auto_reports_it():
    m = Branchy()
    for mode in ("export", "auto"):
        with pytest.raises(ShardcError, match=r"capture export stopped in module 'gate' at .*test_capture\.py:\d+ "
                                              r"\(`if x\.sum\(\) > 0:"):
            capture(m, find_units(m, S), (torch.ones(1, 2),), mode=mode)
    with pytest.raises(ShardcError, match=r"^Branchy needs example inputs: .* pass example_inputs=\(\.\.\.\)"):
        capture(m, find_units(m, S), None, mode="auto")


def test_a_hugging_face_model_without_example_inputs_is_told_to_pass_them():
    # fx cannot trace transformers 5.x ("ValueError: code: co_varnames is too small"); the
    # fix comes first and alone: one sentence naming example_inputs=, not fx's reason.
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardc.compiler.api import compile_source
    m = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                   bos_token_id=0, eos_token_id=0))
    with pytest.raises(ShardcError) as e:
        compile_source(m, "mesh gpu(2)\nparams shard over gpu\ngrads shard over gpu\noptim shard over gpu\n")
    msg = str(e.value)
    assert msg.startswith("GPT2LMHeadModel needs example inputs: ") and "pass example_inputs=(...)" in msg
    assert "co_varnames" not in msg and "\n" not in msg and msg.count(". ") == 0


class GatedUnit(Branchy):
    """Gate's data-dependent branch inside a unit (`units type Gate`)."""


def test_export_hint_fits_code_already_in_a_unit():
    m = GatedUnit()
    s = dataclasses.replace(S, units=UnitsSpec(UnitsKind.TYPE, ("Gate",)))
    units = find_units(m, s)
    assert [u.name for u in units] == ["<root>", "gate"]
    with pytest.raises(ShardcError) as e:
        capture(m, units, (torch.ones(1, 2),), mode="export")
    msg = str(e.value)
    assert "capture export stopped in module 'gate'" in msg and "if x.sum() > 0:" in msg
    assert "inside unit 'gate'" in msg and "move that code into a unit" not in msg


def test_auto_shows_both_reasons():
    m = Branchy()
    with pytest.raises(ShardcError) as e:
        capture(m, find_units(m, S), (torch.ones(1, 2),), mode="auto")
    msg = str(e.value)
    assert msg.startswith("neither capture mode worked")
    assert "capture fx stopped in module 'gate'" in msg and "TraceError" in msg
    assert "capture export stopped in module 'gate'" in msg and "GuardOnDataDependent" in msg


@pytest.mark.parametrize("mode", ["fx", "auto", "export"])
def test_example_inputs_must_fit_the_forward(mode):
    m = tiny()
    units = find_units(m, S)
    (x,) = example_inputs(m)
    with pytest.raises(ShardcError, match=r"the example inputs do not match GPT\.forward\(idx\): "
                                          r"too many positional arguments \(3 given\)"):
        capture(m, units, (x, x, x), mode=mode)
    with pytest.raises(ShardcError, match=r"example inputs do not fit GPT\.forward|capture export stopped"):
        capture(m, units, (x.float()[..., None],), mode=mode)


class TakesCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x, cache=None):
        return self.lin(x)


def test_uncapturable_construct_is_named_with_the_setting():
    """A Hugging Face cache passed in the example inputs: named, with what avoids it."""
    transformers = pytest.importorskip("transformers")
    m = TakesCache()
    with pytest.raises(ShardcError) as e:
        capture(m, find_units(m, S), (torch.ones(1, 2), transformers.DynamicCache()), mode="export")
    msg = str(e.value)
    assert "torch cannot capture the DynamicCache there" in msg and "use_cache=False" in msg
    assert "move that code into a unit" not in msg


def test_cli_reports_one_line_not_a_traceback(tmp_path):
    model = tmp_path / "branchy.py"
    model.write_text(textwrap.dedent('''
        import torch
        from torch import nn
        class M(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(2, 2)
            def forward(self, x):
                if x.sum() > 0:
                    return self.lin(x)
                return x
        def make():
            return M()
    '''))
    strat = tmp_path / "s.shard"
    strat.write_text("mesh gpu(2)\nparams shard over gpu\ngrads shard over gpu\noptim shard over gpu\n")
    r = subprocess.run([sys.executable, "-m", "shardc.cli", "compile", str(strat), "--model", f"{model}:make",
                        "--example-input", "float32[1,2]", "-o", str(tmp_path / "out.py")],
                       capture_output=True, text=True, timeout=HANG_S, cwd=ROOT)
    assert r.returncode == 1
    assert r.stderr.startswith("error: neither capture mode worked — capture fx stopped in module '<root>'")
    assert "capture export stopped in module '<root>'" in r.stderr and "branchy.py:9" in r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_cli_writes_the_module(tmp_path):
    out = tmp_path / "gpt_zero3.py"
    r = subprocess.run([sys.executable, "-m", "shardc.cli", "compile", "examples/strategies/zero3.shard",
                        "--model", "examples/gpt.py:tiny", "--mesh", "node(2) > gpu(2)", "-o", str(out)],
                       capture_output=True, text=True, timeout=HANG_S, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    src = out.read_text()
    compile(src, str(out), "exec")
    assert "def shard_model(model, mesh=None, schedule=SCHEDULE, timeout=None, lowering=None, init=None, device=None," in src and "rt.run_unit(1, " in src


def test_cli_unwritable_output_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")                         # a file where the output's directory should be
    r = subprocess.run([sys.executable, "-m", "shardc.cli", "compile", "examples/strategies/zero3.shard",
                        "--model", "examples/gpt.py:tiny", "--mesh", "node(2) > gpu(2)", "-o", str(blocker / "out.py")],
                       capture_output=True, text=True, timeout=HANG_S, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.startswith(f"error: cannot write {blocker / 'out.py'}: ")
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1
