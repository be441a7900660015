"""DeepSpeed side by side: a ds_config's ZeRO section as a `.shard` strategy, and a DeepSpeed
ZeRO checkpoint as a DCP checkpoint shardc resumes from (docs/deepspeed.md).

Stage: public API beside `shardc.compile`. Input: a ds_config dict; a DeepSpeed
`engine.save_checkpoint` directory. Output: strategy text (checked by `shardc.load_strategy`);
a DCP directory under torch's `get_state_dict` keys (`model.<name>`, `optim.state.<name>.*`,
`optim.param_groups`), which torch's recipe loads into any strategy and world size.

[Note: DeepSpeed's own reader]
The ZeRO file format (flat per-rank partitions, padding, the stage-3 per-rank fragments) is
read by DeepSpeed's `ds_to_universal` only, never re-implemented here: it writes one folder
per parameter (`zero/<name>/fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt`) and merges the ranks'
fragments one parameter at a time. This module then writes those tensors, memory-mapped, into
one DCP checkpoint, from which each shardc rank reads only its own pieces. So no process holds
the whole model's optimizer state at once; the conversion process holds one parameter's tensors
at a time plus the memory maps (ds_to_universal's extraction step loads one rank's
`*_optim_states.pt` file at a time, which is 1/N of the model's states). DeepSpeed is imported
only here, lazily: it is an optional dependency (`pip install shardc[deepspeed]`).
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile

from shardc.dsl.errors import ShardcError

__all__ = ["from_deepspeed_config", "deepspeed_to_dcp", "load_deepspeed"]

_STAGE_SCOPES = {0: ("replicate", "replicate", "replicate"),
                 1: ("replicate", "replicate", "shard over world"),
                 2: ("replicate", "shard over world", "shard over world"),
                 3: ("shard over world", "shard over world", "shard over world")}
# keys of zero_optimization that change nothing shardc plans (it always overlaps and packs)
_NO_LINE = {"overlap_comm", "contiguous_gradients", "allgather_partitions", "reduce_scatter",
            "allgather_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
            "stage3_param_persistence_threshold", "sub_group_size", "round_robin_gradients",
            "stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save",
            "elastic_checkpoint", "ignore_unused_parameters", "load_from_fp32_weights",
            "use_multi_rank_bucket_allreduce"}


def from_deepspeed_config(config: dict, mesh: str = "node(*) > gpu(local)") -> str:
    """The `.shard` text that does what `config`'s (a ds_config dict) ZeRO section does, on a
    two-level mesh (`mesh`: a node level, then the GPUs of a node). Keys shardc has no
    equivalent for (`offload_*`, an hpZ partition that is not the node) are one ShardcError
    naming the key; keys that change nothing here become a comment line."""
    if not isinstance(config, dict):
        raise ShardcError(f"a ds_config must be a dict, got {type(config).__name__}")
    zero = config.get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0))
    if stage not in _STAGE_SCOPES:
        raise ShardcError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    for key in ("offload_optimizer", "offload_param"):
        dev = (zero.get(key) or {}).get("device", "none")
        if dev not in (None, "none"):
            raise ShardcError(f"zero_optimization.{key} (device {dev!r}) has no shardc equivalent: "
                              f"shardc keeps every state on the accelerator; drop the key")
    if zero.get("mics_shard_size", -1) not in (-1, 0, None):
        # MiCS: every state sharded inside a partition of mics_shard_size ranks (the node),
        # replicated across partitions
        params = grads = optim = "shard over gpu"
    else:
        params, grads, optim = _STAGE_SCOPES[stage]
    hpz = int(zero.get("zero_hpz_partition_size", 1) or 1)
    qw, qg = bool(zero.get("zero_quantized_weights")), bool(zero.get("zero_quantized_gradients"))
    for key, on in (("zero_hpz_partition_size", hpz > 1), ("zero_quantized_weights", qw),
                    ("zero_quantized_gradients", qg)):
        if on and stage != 3:
            raise ShardcError(f"zero_optimization.{key} needs stage 3 (DeepSpeed's ZeRO++ is a "
                              f"stage-3 feature), got stage {stage}")
    gpus = _gpus_per_node(mesh)
    if hpz > 1 and gpus is not None and hpz != gpus:
        raise ShardcError(f"zero_optimization.zero_hpz_partition_size {hpz} is not the node's "
                          f"{gpus} GPUs: shardc's secondary copy spans a mesh level; use a mesh "
                          f"whose inner level has {hpz} ranks")
    lines = [f"# from a ds_config: ZeRO stage {stage}", f"mesh {mesh}"]
    p = f"params {params}" + (" secondary gpu" if hpz > 1 else "") + (" comm int8" if qw else "")
    g = f"grads  {grads}" + (" comm int4" if qg else "")
    lines += [p, g, f"optim  {optim}"]
    acc = config.get("gradient_accumulation_steps")
    if isinstance(acc, int) and acc > 1:
        lines.append(f"accumulate {acc}")
    if "reduce_bucket_size" in zero:
        # DeepSpeed counts elements; shardc's bucket is bytes of the fp32 parameters it fuses
        lines.append(f"bucket {int(float(zero['reduce_bucket_size'])) * 4}")
    if "stage3_prefetch_bucket_size" in zero:
        lines.append(f"prefetch {1 if float(zero['stage3_prefetch_bucket_size']) > 0 else 0}")
    ignored = sorted(k for k in zero if k in _NO_LINE)
    if ignored:
        lines.append("# no line needed (shardc always overlaps and packs): " + ", ".join(ignored))
    unknown = sorted(k for k in zero if k not in _NO_LINE and k not in _KNOWN)
    if unknown:
        raise ShardcError(f"zero_optimization.{unknown[0]} has no shardc equivalent here")
    return "\n".join(lines) + "\n"


_KNOWN = {"stage", "offload_optimizer", "offload_param", "mics_shard_size", "mics_hierarchical_params_gather",
          "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients",
          "reduce_bucket_size", "stage3_prefetch_bucket_size"}


def _gpus_per_node(mesh: str) -> int | None:
    levels = [lv.strip() for lv in mesh.split(">")]
    inner = levels[-1]
    size = inner[inner.find("(") + 1:inner.rfind(")")]
    return int(size) if size.isdigit() else None


# ---------------------------------------------------------------- checkpoints


def _tag_dir(src: str, tag: str | None) -> str:
    if not os.path.isdir(src):
        raise ShardcError(f"DeepSpeed checkpoint {src} is not a directory")
    if tag is None and not glob.glob(os.path.join(src, "*_optim_states.pt")):
        latest = os.path.join(src, "latest")
        if not os.path.isfile(latest):
            raise ShardcError(f"DeepSpeed checkpoint {src} has no 'latest' file and no "
                              f"*_optim_states.pt files; pass tag= (the save's tag)")
        with open(latest) as f:
            tag = f.read().strip()
    d = os.path.join(src, tag) if tag else src
    if not os.path.isdir(d):
        raise ShardcError(f"DeepSpeed checkpoint {src} has no tag directory {tag!r}")
    return d


def _check_files(d: str) -> None:
    optim = sorted(glob.glob(os.path.join(d, "*_optim_states.pt")))
    model = sorted(glob.glob(os.path.join(d, "*mp_rank_*_model_states.pt")))
    if not optim:
        raise ShardcError(f"DeepSpeed checkpoint {d} has no *_optim_states.pt files (a save "
                          f"without its ZeRO optimizer partitions cannot be resumed)")
    if not model:
        raise ShardcError(f"DeepSpeed checkpoint {d} has no mp_rank_*_model_states.pt files "
                          f"({len(optim)} optimizer partitions without their model-state files)")
    import torch
    head = torch.load(optim[0], map_location="cpu", weights_only=False, mmap=True)
    osd = head.get("optimizer_state_dict", {})
    saved = osd.get("partition_count")
    saved = saved[0] if isinstance(saved, (list, tuple)) else saved
    if isinstance(saved, int) and saved != len(optim):
        raise ShardcError(f"DeepSpeed checkpoint {d} was saved by {saved} ranks but holds "
                          f"{len(optim)} *_optim_states.pt files: partitions are missing, and "
                          f"DeepSpeed's reader cannot merge an incomplete set")
    stage = int(osd.get("zero_stage", 1))
    if stage == 3 and len(model) != len(optim):
        raise ShardcError(f"DeepSpeed ZeRO-3 checkpoint {d} holds {len(optim)} optimizer "
                          f"partitions but {len(model)} zero_pp_rank_*_mp_rank_*_model_states.pt "
                          f"files: stage 3 needs one model-state file per rank")


def _universal(d: str, out: str) -> None:
    from types import SimpleNamespace
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.checkpoint import ds_to_universal
    except ImportError as e:
        raise ShardcError(f"reading a DeepSpeed checkpoint needs deepspeed "
                          f"(pip install 'shardc[deepspeed]'): {e}") from None
    args = SimpleNamespace(input_folder=d, output_folder=out, num_extract_workers=1,
                           num_merge_workers=1, keep_temp_folder=False, strict=True,
                           inject_missing_state=True)
    import contextlib
    import io
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ds_to_universal.main(args)
    except Exception as e:                                  # noqa: BLE001 — one sentence
        raise ShardcError(f"DeepSpeed's reader (ds_to_universal) could not read {d}: "
                          f"{type(e).__name__}: {e}") from None


def _load(path):
    import torch
    t = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    return t["param"] if isinstance(t, dict) else t


def _step(zero: str, name: str) -> float | None:
    p = os.path.join(zero, name, "step.pt")
    if os.path.isfile(p):
        s = _load(p)
        return float(s.item() if hasattr(s, "item") else s)
    return None


def deepspeed_to_dcp(src: str, dst: str, tag: str | None = None) -> list[str]:
    """Convert a DeepSpeed ZeRO-1/2/3 checkpoint (`engine.save_checkpoint(src)`, the tag in
    `latest` unless `tag` names one) into a DCP checkpoint at `dst` holding every parameter in
    fp32 and AdamW's `exp_avg`, `exp_avg_sq` and `step` under torch's `get_state_dict` keys.
    One process (no process group needed). Returns the parameter names. See
    [Note: DeepSpeed's own reader]."""
    import torch
    import torch.distributed.checkpoint as dcp
    d = _tag_dir(src, tag)
    _check_files(d)
    work = tempfile.mkdtemp(prefix="shardc-ds-universal-")
    try:
        _universal(d, os.path.join(work, "u"))
        zero = os.path.join(work, "u", "zero")
        names = sorted(n for n in os.listdir(zero) if os.path.isdir(os.path.join(zero, n)))
        common = torch.load(os.path.join(zero, "optimizer_state.pt"), map_location="cpu",
                            weights_only=False)
        groups = common.get("param_groups") or common["optimizer_state_dict"]["param_groups"]
        flat_state = common.get("optimizer_state_dict", {}).get("state", {})
        group_step = next((float(s["step"]) for s in flat_state.values()
                           if isinstance(s, dict) and "step" in s), None)
        if len(groups) != 1:
            raise ShardcError(f"DeepSpeed checkpoint {d} has {len(groups)} optimizer param "
                              f"groups; only one is converted so far")
        # the parameters' shapes as DeepSpeed recorded them (ZeRO-3's universal tensors are flat)
        first = sorted(glob.glob(os.path.join(d, "*mp_rank_*_model_states.pt")))[0]
        head = torch.load(first, map_location="cpu", weights_only=False, mmap=True)
        shapes = {}
        for group in head.get("param_shapes") or []:
            shapes.update({k: tuple(v) for k, v in group.items()})
        if shapes:        # ds_to_universal also writes fp32.pt for buffers: those are no parameters
            names = [n for n in names if n in shapes]
        model, state = {}, {}
        for n in names:
            t = _load(os.path.join(zero, n, "fp32.pt")).float()
            model[n] = t.reshape(shapes[n]) if n in shapes else t
            st = {}
            for key in ("exp_avg", "exp_avg_sq"):
                p = os.path.join(zero, n, f"{key}.pt")
                if os.path.isfile(p):
                    st[key] = _load(p).float().reshape(model[n].shape)
            step = _step(zero, n)
            step = group_step if step is None else step
            if st and step is not None:
                st["step"] = torch.tensor(step)
            if st:
                state[n] = st
        # buffers (not ZeRO-partitioned) are in the first rank's model-state file, whole
        module = head.get("module") or {}
        for k, v in module.items():
            if k not in model and torch.is_tensor(v) and k not in names:
                model[k] = v
        hyper = {k: v for k, v in groups[0].items() if k != "params"}
        osd = {"state": state, "param_groups": [{**hyper, "params": names}]}
        dcp.save({"model": model, "optim": osd}, checkpoint_id=dst, no_dist=True)
        return names
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load_deepspeed(sm, opt, src: str, tag: str | None = None, work_dir: str | None = None) -> None:
    """Resume `sm` (a ShardedModule) and `opt` (its optimizer) from a DeepSpeed checkpoint:
    the first rank converts it (`deepspeed_to_dcp`, into `work_dir` or `src/<tag>-dcp`), then
    every rank loads its own pieces through torch's recipe. Collective. A parameter whose
    shape is not the model's is one sentence naming it."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from shardc.runtime.state.load_errors import checkpoint_errors
    out = work_dir or os.path.join(src, f"{tag or 'latest'}-dcp")
    err = None
    if dist.get_rank() == 0:
        try:
            deepspeed_to_dcp(src, out, tag=tag)
        except ShardcError as e:
            err = str(e)
    box = [err]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise ShardcError(box[0])
    msd, osd = get_state_dict(sm, opt)
    saved = set(dcp.FileSystemReader(out).read_metadata().state_dict_metadata)
    missing = sorted(k for k in msd if f"model.{k}" not in saved)
    if missing:
        raise ShardcError(f"DeepSpeed checkpoint {src} has no parameter {missing[0]!r} of the "
                          f"model ({len(missing)} missing; tied parameters are saved once by "
                          f"DeepSpeed and are not mapped yet)")
    state = {"model": msd, "optim": osd}
    with checkpoint_errors(out):
        dcp.load(state, checkpoint_id=out)
    set_state_dict(sm, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    del torch
