"""shardc/cli/loader.py: factory specs resolve to modules; every mistake is one ShardcError sentence."""
import textwrap

import pytest
from torch import nn

from shardc.cli.loader import build_model, load_factory
from shardc.dsl.errors import ShardcError


@pytest.fixture
def model_file(tmp_path):
    p = tmp_path / "mymodel.py"
    p.write_text(textwrap.dedent("""
        from torch import nn
        NOT_CALLABLE = 3
        def good():
            return nn.Linear(2, 3)
        def bad():
            raise ValueError("boom")
        def wrong():
            return 42
    """))
    return p


def test_file_factory(model_file):
    f = load_factory(f"{model_file}:good")
    m = f()
    assert isinstance(m, nn.Linear) and m.out_features == 3


def test_dotted_factory():
    f = load_factory("torch.nn:Identity")
    assert isinstance(f(), nn.Identity)


def test_build_model_meta(model_file):
    m = build_model(f"{model_file}:good", device="meta")
    assert m.weight.device.type == "meta"


@pytest.mark.parametrize("suffix,needle", [
    (":missing", "has no attribute 'missing'"),
    (":NOT_CALLABLE", "is not callable"),
])
def test_attribute_errors(model_file, suffix, needle):
    with pytest.raises(ShardcError, match=needle):
        load_factory(f"{model_file}{suffix}")


def test_file_not_found(tmp_path):
    with pytest.raises(ShardcError, match="not found"):
        load_factory(f"{tmp_path}/nope.py:f")


def test_bad_spec():
    with pytest.raises(ShardcError, match="PATH.py:FACTORY"):
        load_factory("just_a_name")


def test_factory_raised(model_file):
    with pytest.raises(ShardcError, match="raised ValueError: boom"):
        build_model(f"{model_file}:bad")


def test_not_a_module(model_file):
    with pytest.raises(ShardcError, match="did not return an nn.Module"):
        build_model(f"{model_file}:wrong")


def test_dotted_factory_from_the_working_directory(tmp_path):
    # `shardc explain ... --model examples.gpt:small` from the repository root: the console
    # script's sys.path starts with its own directory, not the working directory as with
    # `python -m`, so the CLI puts the working directory there itself. `-P` runs the CLI
    # the way the `shardc` script does (nothing prepended to sys.path).
    import json
    import os
    import subprocess
    import sys
    (tmp_path / "mymodels").mkdir()
    (tmp_path / "mymodels" / "net.py").write_text(
        "from torch import nn\ndef build():\n    return nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))\n")
    shard = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "strategies",
                         "zero3.shard")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    r = subprocess.run([sys.executable, "-P", "-m", "shardc.cli", "explain", shard, "--model", "mymodels.net:build",
                        "--mesh", "gpu(2)", "--json", "--no-graph"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["params"] == 8 * 4 + 4 * 8 + 8
