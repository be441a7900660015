"""The optimizer registry (`shardc.lowering.optimizers`) against torch.optim itself: every
name is a torch class, and K_state is what torch's own optimizer keeps per element."""
import pytest
import torch

from shardc.lowering.optimizers import DEFAULT_OPTIMIZER, OPTIMIZER_KINDS, optimizer_kind
from shardc.runtime import ELEMENTWISE

N = 1000


def _state_bytes_per_element(cls, **kw) -> float:
    p = torch.nn.Parameter(torch.randn(25, N // 25))   # 2-D: Muon takes matrices only
    opt = cls([p], lr=0.01, **kw)
    p.grad = torch.randn(25, N // 25)
    opt.step()
    held = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if torch.is_tensor(t) and t.dim() > 0)
    return held / N


def test_every_kind_is_a_torch_optimizer():
    assert all(isinstance(getattr(torch.optim, n, None), type) for n in OPTIMIZER_KINDS)
    assert optimizer_kind(DEFAULT_OPTIMIZER) is OPTIMIZER_KINDS["AdamW"]


def test_the_runtime_shards_exactly_the_element_wise_kinds():
    assert {c.__name__ for c in ELEMENTWISE} == {n for n, k in OPTIMIZER_KINDS.items() if k.elementwise}
    assert "LBFGS" not in {c.__name__ for c in ELEMENTWISE}


CASES = [("AdamW", {}), ("AdamW", {"amsgrad": True}), ("Adam", {}), ("Adam", {"amsgrad": True}),
         ("SGD", {}), ("SGD", {"momentum": 0.9}), ("Adagrad", {}), ("RMSprop", {}),
         ("RMSprop", {"momentum": 0.9}), ("RMSprop", {"centered": True}),
         ("RMSprop", {"momentum": 0.9, "centered": True}), ("Muon", {})]


@pytest.mark.parametrize("name,kw", CASES)
def test_k_state_is_what_torch_keeps(name, kw):
    assert OPTIMIZER_KINDS[name].k_state(**kw) == _state_bytes_per_element(getattr(torch.optim, name), **kw)


def test_every_predicted_kind_is_checked_against_torch():
    assert {n for n, k in OPTIMIZER_KINDS.items() if k.state_bytes is not None} == {n for n, _ in CASES}
