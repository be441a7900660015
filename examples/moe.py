"""A small mixture-of-experts decoder: the example MoE of shardc's expert-parallel tests and benchmark.

`MoE(cfg)`: token embedding, `layers` (a ModuleList of blocks: RMSNorm, causal multi-head
attention without position embeddings, RMSNorm, a routed MoE layer), final RMSNorm and an
untied `head`. Each block's `moe` holds a `router` (top-k of the logits, softmax over the k as
gates) and `experts` (`Experts`: SwiGLU experts as 3-D parameters `w1` (E, F, D), `w2`
(E, D, F), `w3` (E, F, D), dim 0 the experts), so the glob "*.experts" names
`layers.N.moe.experts` and its parameters `layers.N.moe.experts.w1` etc.

The MoE layer sorts each token's k copies by expert and calls
`experts(x_sorted, num_tokens_per_expert)`, which runs every expert on its rows as one
grouped matmul (`F.grouped_mm`, torchtitan's GroupedExperts): exact on CPU in fp32, and it
traces on meta tensors, so `explain` counts the active experts. D and F must be multiples of
8 (the grouped matmul's 16-byte strides).

`ExpertParallel` (a torch ParallelStyle, torchtitan's shape) places the experts' parameters
Shard(0) on a 1-D ep DeviceMesh and dispatches tokens: the per-expert counts are exchanged,
the tokens of each ep rank's experts go there (`all_to_all_single_autograd`, uneven splits,
gloo included), run on the local experts and come back the same way; the gates are applied
by the MoE layer. `apply_ep(model, ep_mesh)` applies it to every `Experts`. Each experts
module counts in `dispatched_bytes` the token bytes this rank sends into the two all-to-alls
of every forward call (the ledger's convention: an all-to-all's input; the counts exchange
and the backward's all-to-alls excluded; a recomputed forward counts again).

On meta (or fake) tensors, as in `shardc simulate`, the per-expert counts have no values to
read: the dispatch then takes a fixed, balanced routing ([Note: the dispatch on meta
tensors]), so a simulated rank runs the same all-to-alls with the sizes of an even split.

Factories: `moe_tiny()` (built on the current device); `moe_tiny_ep(ep_mesh=None)`,
`deepseek_v3(ep_mesh=None)` and `mixtral(ep_mesh=None)` (the papers' shapes, for the meta
device), which place their experts on `ep_mesh` when given (`shardc simulate` passes the
simulated rank's); `init_module` initializes one module of a model built on the meta device
(`model.to_empty(device=...); model.apply(init_module)`). Options beyond the tiny model:
dense first blocks (`n_dense_layers`, `dense_dim`) and shared experts (`n_shared`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module


@dataclass(frozen=True, slots=True)
class MoEConfig:
    vocab: int = 128
    dim: int = 32             # D
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 4        # E
    top_k: int = 2
    expert_dim: int = 48      # F, each expert's SwiGLU hidden size
    eps: float = 1e-6
    n_dense_layers: int = 0   # the first blocks run a dense SwiGLU of dense_dim instead (DeepSeek-V3's 3)
    dense_dim: int = 0
    n_shared: int = 0         # shared experts beside the routed ones: one dense SwiGLU of n_shared * F


TINY = MoEConfig()


class Attention(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class Experts(nn.Module):
    """E SwiGLU experts: rows of `x` grouped by expert, `num_tokens_per_expert[e]` rows for
    expert e. Under ExpertParallel the parameters are DTensors and this runs the local shard."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.reset_parameters()

    def reset_parameters(self):
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, mean=0.0, std=0.02)

    def forward(self, x, num_tokens_per_expert):
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        offs = num_tokens_per_expert.cumsum(0, dtype=torch.int32)
        h = F.silu(F.grouped_mm(x, w1.transpose(-2, -1), offs=offs)) * F.grouped_mm(x, w3.transpose(-2, -1), offs=offs)
        return F.grouped_mm(h, w2.transpose(-2, -1), offs=offs)


class SwiGLU(nn.Module):
    """A dense SwiGLU feed-forward (the dense blocks' MLP, and the shared experts)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoELayer(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.expert_dim)
        self.shared = SwiGLU(cfg.dim, cfg.n_shared * cfg.expert_dim) if cfg.n_shared else None

    def forward(self, x):
        flat = x.reshape(-1, x.size(-1))                                    # (N, D)
        logits, ids = self.router(flat).topk(self.top_k, dim=-1)            # (N, k) each
        gates = logits.softmax(-1)
        ids = ids.flatten()
        order = ids.argsort(stable=True)                                    # token copies by expert
        counts = ids.new_zeros(self.n_experts).scatter_add_(0, ids, torch.ones_like(ids))
        y = self.experts(flat[order // self.top_k], counts)[order.argsort()]
        y = (y.view(-1, self.top_k, flat.size(-1)) * gates.unsqueeze(-1)).sum(1).view_as(x)
        return y if self.shared is None else y + self.shared(x)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, dense: bool = False):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.attn = Attention(cfg)
        self.moe_norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.moe = SwiGLU(cfg.dim, cfg.dense_dim) if dense else MoELayer(cfg)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig = TINY):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i < cfg.n_dense_layers) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.apply(init_module)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def init_module(m):
    """Values for one module (also of a model built on the meta device, after `to_empty`):
    its own reset_parameters() (RMSNorm's ones, the experts' normal(0.02)), then normal(0.02)
    for every Linear and Embedding weight."""
    if hasattr(m, "reset_parameters"):
        m.reset_parameters()
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)


def moe(**cfg) -> MoE:
    return MoE(MoEConfig(**cfg))


def moe_tiny() -> MoE:
    """Two blocks of 4 experts (E=4, F=48, D=32, top-2), vocab 128; seeded, so every rank builds the same."""
    torch.manual_seed(0)
    return MoE(TINY)


# The papers' shapes in this example's architecture (plain multi-head attention, SwiGLU
# experts), for `shardc simulate` and `explain` on the meta device: 672.1B and 47.5B parameters
# (the papers': 671B and 46.7B).
# DeepSeek-V3 (arXiv:2412.19437): D 7168, 61 blocks of which the first 3 dense (F 18432),
# 256 routed experts of F 2048, top-8, one shared expert, vocab 129280 (its MLA attention is
# written as multi-head attention of 128 heads: 205M parameters a block where MLA has 187M).
DEEPSEEK_V3 = MoEConfig(vocab=129280, dim=7168, n_layers=61, n_heads=128, n_experts=256, top_k=8,
                        expert_dim=2048, n_dense_layers=3, dense_dim=18432, n_shared=1)
# Mixtral 8x7B (arXiv:2401.04088): D 4096, 32 blocks, 8 experts of F 14336, top-2, vocab 32000
# (its grouped-query attention, 8 key-value heads, written as 32 full heads: 67M a block against 42M).
MIXTRAL = MoEConfig(vocab=32000, dim=4096, n_layers=32, n_heads=32, n_experts=8, top_k=2, expert_dim=14336)


def deepseek_v3(ep_mesh=None) -> MoE:
    """DeepSeek-V3's shapes; build it on the meta device. `ep_mesh`: see `moe_tiny_ep`."""
    model = MoE(DEEPSEEK_V3)
    return model if ep_mesh is None else apply_ep(model, ep_mesh)


def mixtral(ep_mesh=None) -> MoE:
    """Mixtral 8x7B's shapes; build it on the meta device. `ep_mesh`: see `moe_tiny_ep`."""
    model = MoE(MIXTRAL)
    return model if ep_mesh is None else apply_ep(model, ep_mesh)


def moe_tiny_ep(ep_mesh=None) -> MoE:
    """`moe_tiny()` with its experts placed on `ep_mesh` when given: `shardc simulate` passes
    a factory that takes `ep_mesh` the simulated rank's 1-D ep DeviceMesh (None where no
    process group exists yet, as for explain's sizes: the experts stay plain tensors)."""
    model = moe_tiny()
    return model if ep_mesh is None else apply_ep(model, ep_mesh)


class ExpertParallel(ParallelStyle):
    """Expert parallelism for an `Experts` module on a 1-D ep DeviceMesh (see the module
    docstring): the parameters Shard(0) over ep, each rank holding E/ep consecutive experts,
    and the token dispatch and combine as the module's input and output functions."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if device_mesh.ndim != 1 or module.w1.shape[0] % device_mesh.size():
            raise ValueError(f"ExpertParallel needs a 1-D ep mesh whose size divides the experts "
                             f"({module.w1.shape[0]} experts, mesh shape {tuple(device_mesh.shape)})")
        module.dispatched_bytes = 0
        return distribute_module(module, device_mesh, self._partition, self._dispatch, self._combine)

    def _partition(self, name, module, device_mesh):
        for pname, p in module.named_parameters(recurse=False):
            dp = distribute_tensor(p, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dp, requires_grad=p.requires_grad))

    def _dispatch(self, module, inputs, device_mesh):
        """(tokens sorted by global expert, counts per global expert) -> (the tokens this
        rank's experts serve, sorted by local expert, counts per local expert). On meta or
        fake tensors the counts have no values: the fixed routing of `_balanced` stands in."""
        x, counts = inputs
        ep, group = device_mesh.size(), device_mesh.get_group()
        if _no_values(counts):
            return self._balanced(module, x, counts, ep, group)
        with torch.no_grad():
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts, group=group)
        received = received.view(ep, -1)                   # [source rank, local expert]
        self.send = counts.view(ep, -1).sum(1).tolist()
        self.recv = received.sum(1).tolist()
        module.dispatched_bytes += x.numel() * x.element_size()
        x = all_to_all_single_autograd(x, self.recv, self.send, group)
        local = torch.arange(received.size(1), device=x.device).repeat(ep)
        self.order = local.repeat_interleave(received.flatten()).argsort(stable=True)
        return x[self.order], received.sum(0)

    def _balanced(self, module, x, counts, ep, group):
        """[Note: the dispatch on meta tensors] The routing is taken as balanced: this rank's
        R token copies go to the ep ranks in equal parts (R // ep, the first R % ep ranks
        one more), every rank receives what it sends (each holds as many token copies), and
        its experts' rows arrive grouped already (the order is the identity): only shapes
        and the all-to-alls' sizes follow, which is what a meta step needs. The counts per
        local expert keep their shape, without values."""
        rows = x.size(0)
        self.send = self.recv = [rows // ep + (r < rows % ep) for r in range(ep)]
        module.dispatched_bytes += x.numel() * x.element_size()
        x = all_to_all_single_autograd(x, self.recv, self.send, group)
        self.order = torch.arange(x.size(0), device=x.device)
        return x, counts.view(ep, -1).sum(0)

    def _combine(self, module, out, device_mesh):
        """The experts' rows back to their source ranks, in the order they were sent."""
        out = out[self.order.argsort()]
        module.dispatched_bytes += out.numel() * out.element_size()
        return all_to_all_single_autograd(out, self.send, self.recv, device_mesh.get_group())


def _no_values(t: torch.Tensor) -> bool:
    """A meta tensor, or a fake one (torch's FakeTensorMode): shapes without values."""
    from torch._subclasses.fake_tensor import is_fake
    return t.is_meta or is_fake(t)


def apply_ep(model: nn.Module, ep_mesh) -> nn.Module:
    """ExpertParallel on every `Experts` module of `model` (each its own style instance)."""
    for m in model.modules():
        if isinstance(m, Experts):
            parallelize_module(m, ep_mesh, ExpertParallel())
    return model
