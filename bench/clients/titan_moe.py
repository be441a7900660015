"""torchtitan's DeepSeek-V3 debug model with its own expert parallelism, for
bench/clients/torchtitan_moe_check.py (bench stage: args -> the model, torchtitan's EP and
load-balancing hook, the batches, the single-process reference, shardc's side; information
only).

Input: the harness's parsed args. Output: `build`/`build_ep` (the plain model, and torchtitan's
EP model holding the same values), `reference` (one process on the concatenated batches,
torchtitan's hook on its optimizer), `strategy`/`sharded`/`train_sharded` (shardc's side),
`Refs` (the references, computed once, rank by rank) and `compare_state`.
torchtitan_moe_check.py documents what each check asserts.
"""
from __future__ import annotations

import dataclasses
import os
import time
import types

from titan_common import gather, get_rank, get_world, make_opt, plain, rel_err, two_level

ROOT = next(p for p in __import__("pathlib").Path(__file__).resolve().parents if (p / "pyproject.toml").exists()).as_posix()
MOE = os.path.join(ROOT, "examples", "strategies", "moe")
STRATEGIES = ("ep2_zero3", "ep_zero3", "hpz_ep2", "paro_iig_ep_zero1")
LOSS_TOL = 1e-6     # the mean loss: fp32 rounding of the per-rank means
PATTERN = "*.inner_experts"
BACKEND = "partial_dtensor"


_PD: dict = {}


def setup_titan(args) -> None:
    """What torchtitan's EP needs on gloo/CPU (once per process)."""
    import torchtitan.distributed.parallel_dims as pdm
    from torchtitan.distributed import utils as dist_utils
    pdm.device_type = "cpu"            # tools.utils.device_type falls back to "cuda" without an accelerator
    dist_utils.set_spmd_backend(BACKEND)
    if args.experts_dtype == "fp32":
        _patch_fp32_experts()


def _patch_fp32_experts() -> None:
    """GroupedExperts.forward without its bf16 casts (torchtitan 0.3.0's body otherwise)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts

    def forward(self, x_RD, num_tokens_per_expert_E):
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h = F.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offs))
        h = h * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offs)
        return self._grouped_mm(A=h, B_t=w2.transpose(-2, -1), offs=offs).type_as(x_RD)
    GroupedExperts.forward = forward


def config(args, ep: int = 1):
    from torchtitan.config import ParallelismConfig
    from torchtitan.experiments.graph_trainer.deepseek_v3 import model_registry
    cfg = model_registry("debugmodel", attn_backend="sdpa").model
    if ep > 1:
        cfg.update_from_config(config=types.SimpleNamespace(parallelism=ParallelismConfig(
            expert_parallel_degree=ep, data_parallel_shard_degree=-1, spmd_backend=BACKEND)))
    cfg.layers = cfg.layers[:args.layers]
    return cfg


def build(args, seed: int = 0, device="cpu"):
    """The plain debug model (one process), torchtitan's init from `seed`; on meta: no values."""
    import torch
    cfg = config(args)
    with torch.device("meta"):
        model = cfg.build()
    if device == "meta":
        return model
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device(device))
    return model.train()


def parallel_dims(ep: int):
    """torchtitan's ParallelDims for EP `ep` (dp_shard = every rank, ep borrowed from it), and
    shardc's mesh: its ('world',) mesh unflattened into (node, gpu)."""
    if ep not in _PD:
        from torchtitan.distributed import ParallelDims
        world = get_world()
        pd = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=ep, world_size=world,
                          spmd_backend=BACKEND)
        pd.build_mesh()
        dp = pd.world_mesh._unflatten(0, (2, world // 2), ("node", "gpu"))
        _PD[ep] = (pd, dp)
    return _PD[ep]


def is_expert(name: str) -> bool:
    return ".inner_experts." in name


def build_ep(args, ep: int, init: dict):
    """torchtitan's EP model for `ep`, holding `init`'s values (this rank's experts)."""
    import torch
    from torch.distributed.tensor import DTensor
    pd, _ = parallel_dims(ep)
    cfg = config(args, ep)
    with torch.device("meta"):
        model = cfg.build()
    model.parallelize(pd)                       # EP only: no FSDP, no compile
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
        r = pd.get_mesh("ep").get_local_rank()
        for n, p in model.named_parameters():
            full = init[n]
            if is_expert(n):
                assert isinstance(p, DTensor), n
                p.to_local().copy_(full.chunk(ep, 0)[r])
            else:
                p.copy_(full)
    return model.train()


def moe_layers(model):
    return [b.moe for b in model.layers.values() if getattr(b, "moe_enabled", False)]


def biases(model):
    import torch
    return torch.stack([m.expert_bias_E.detach().clone() for m in moe_layers(model)])


def counts(model):
    import torch
    return torch.stack([m.tokens_per_expert_E.detach().clone() for m in moe_layers(model)])


def hook(opt, model, pd) -> None:
    """torchtitan's `post_optimizer_build_fn` for the DeepSeek-V3 spec (None: one process)."""
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    pd = pd or types.SimpleNamespace(get_optional_mesh=lambda *_: None, ep_enabled=False, tp=1)
    register_moe_load_balancing_hook(opt, [model], pd)


def batches(args, steps: int):
    import torch
    g, v = torch.Generator().manual_seed(11), config(args).vocab_size
    return [torch.randint(0, v, (args.global_batch, args.seq + 1), generator=g) for _ in range(steps)]


def micro_batches(tok, world: int, micro: int):
    """[rank][k]: rank r's k-th micro-batch (rank r takes its contiguous slice of the batch)."""
    return [list(t.chunk(micro)) for t in tok.chunk(world)]


def ce(model, tok):
    import torch.nn.functional as F
    return F.cross_entropy(model(tok[:, :-1]).float().flatten(0, 1), tok[:, 1:].flatten())


def reference(args, kind: str, micro: int, init_model, chunks: int = 1):
    """One process on the concatenated batches, torchtitan's hook on its optimizer: the final
    state_dict, and per step the loss, the counts the hook reads and the bias after it.
    Micro-batch k is every rank's k-th concatenated; `chunks` > 1 accumulates each
    rank's piece of it on its own (the floor run)."""
    import copy
    import torch
    world = get_world()
    model = copy.deepcopy(init_model)
    opt = make_opt(kind, model.parameters())
    hook(opt, model, None)
    out = dict(loss=[], counts=[], bias=[], grad_norm=[])
    for tok in batches(args, args.steps):
        per = micro_batches(tok, world, micro)
        total = 0.0
        for k in range(micro):
            if chunks == 1:
                loss = ce(model, torch.cat([per[r][k] for r in range(world)])) / micro
                loss.backward()
                total += float(loss.detach())
            else:
                for r in range(world):
                    loss = ce(model, per[r][k]) / (micro * world)
                    loss.backward()
                    total += float(loss.detach())
        if args.clip:
            out["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)))
        out["counts"].append(counts(model))          # what the hook reads
        opt.step()
        opt.zero_grad()
        out["loss"].append(total)
        out["bias"].append(biases(model))
    return plain(model.state_dict()), out


def loss_tol(floor: float) -> float:
    return max(LOSS_TOL, 3 * floor)


def strategy(name: str, micro: int, buffers: str | None = None):
    """An examples/strategies/moe strategy on node(2) > gpu(W/2), the experts' pattern
    torchtitan's, `accumulate` = micro (and `buffers`, if given)."""
    import shardc
    from shardc.dsl.ir import BufferSync
    s = shardc.load_strategy(os.path.join(MOE, f"{name}.shard"), mesh=two_level(get_world()))
    s = dataclasses.replace(s, experts=dataclasses.replace(s.experts, pattern=PATTERN), accumulate=micro)
    if buffers:
        s = dataclasses.replace(s, buffers=BufferSync(buffers))
    return s


def sharded(args, s, init: dict):
    """torchtitan's EP model under shardc's `s` (`--entry`); (sm, torchtitan's ParallelDims)."""
    import torch
    import shardc
    from shardc.analysis.costmodel.bucketing import resolve_bucket
    from shardc.runtime import shard_module
    from shardc.units import find_units
    ep = s.experts.ep
    model = build_ep(args, ep, init)
    pd, dp = parallel_dims(ep)
    if args.entry == "compile":
        x = torch.zeros(args.global_batch // get_world() // s.accumulate, args.seq, dtype=torch.long)
        return shardc.compile(model, s, example_inputs=(x,), mesh=dp, timeout=1800), pd
    return shard_module(model, s, find_units(model, resolve_bucket(model, s)), mesh=dp, timeout=1800), pd


def train_sharded(args, sm, opt, micro: int, steps: int | None = None, on_step=None) -> list[float]:
    """Each rank its slice of every global batch, `micro` micro-batches a step; the mean
    loss over ranks per step."""
    import torch
    import torch.distributed as dist
    world, rank = get_world(), get_rank()
    losses = []
    for tok in batches(args, args.steps if steps is None else steps):
        total = 0.0
        for mb in micro_batches(tok, world, micro)[rank]:
            loss = ce(sm, mb) / micro
            loss.backward()
            total += float(loss.detach())
        if args.clip:
            sm.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad()
        t = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / world)
        if on_step:
            on_step()
    return losses


class Refs:
    """References by key: key -> (optimizer kind, micro-batches), each computed by one
    rank (ranks 0, 1, ... in turn), which keeps its state dict; the per-step figures and
    the floors go to every rank."""

    def __init__(self, args, init_model, jobs: dict):
        world, rank = get_world(), get_rank()
        self.holder = {key: i % world for i, key in enumerate(jobs)}
        self.state, small = {}, {}
        t0 = time.perf_counter()
        for key, (kind, micro) in jobs.items():
            if rank != self.holder[key]:
                continue
            sd, fig = reference(args, kind, micro, init_model)
            alt_sd, alt = reference(args, kind, micro, init_model, chunks=world)
            self.state[key] = sd
            small[key] = dict(fig, floor=rel_err(alt_sd, sd)[0],
                              floor_loss=max(abs(a - b) / abs(b) for a, b in zip(alt["loss"], fig["loss"])),
                              floor_bias=max(float((a - b).abs().max()) for a, b in zip(alt["bias"], fig["bias"])))
        self.fig = {}
        for d in gather(small):
            self.fig.update(d)
        self.seconds = time.perf_counter() - t0


def compare_state(refs: Refs, key, got: dict, params_only: bool = False):
    """(keys equal and in order, max rel err, worst key, keys), computed on the holder, known
    everywhere; `params_only`: the error over the parameters (expert_bias_E left out)."""
    r = None
    if get_rank() == refs.holder[key]:
        want = refs.state[key]
        if params_only:
            want = {k: v for k, v in want.items() if not k.endswith("expert_bias_E")}
            got = {k: v for k, v in got.items() if not k.endswith("expert_bias_E")}
        keys = list(got) == list(want)
        err, where = rel_err(got, want) if set(got) == set(want) else (float("inf"), "keys differ")
        r = (keys, err, where, len(want))
    return gather(r)[refs.holder[key]]
