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
