"""And back to DeepSpeed: a shardc DCP checkpoint as a DeepSpeed universal checkpoint
(docs/deepspeed.md, "And back").

Stage: public API beside `shardc.deepspeed` (the way in). Input: a DCP directory under torch's
`get_state_dict` keys (`model.<name>`, `optim.state.<name>.<key>`, `optim.param_groups.<i>.*`),
as shardc's checkpoints are written (docs/checkpoints.md). Output: a folder that DeepSpeed's
`engine.load_checkpoint(folder)` loads with `"checkpoint": {"load_universal": true}` in its
ds_config, under any ZeRO stage (1, 2, 3) and data-parallel world size.

[Note: what the universal layout holds]
DeepSpeed's universal checkpoint (the format `ds_to_universal` writes and its
`load_universal` path reads) keeps one folder per parameter, `<tag>/zero/<name>/` with
`fp32.pt`, `exp_avg.pt`, `exp_avg_sq.pt` (each `{"param": tensor}` in the parameter's
shape) and `step.pt`; `<tag>/zero/optimizer_state.pt` with the param group's hyperparameters
(stage 1/2 read `param_groups`, stage 3 `optimizer_state_dict`'s `param_groups` and the step
of `state[0]`); and the model-state file, from which DeepSpeed's universal load reads only the
counters (`global_steps`, `skipped_steps`, world sizes), never `module`. Each DeepSpeed rank
then cuts its own partition out of the per-parameter files. This writer fills exactly those
fields: parameters and AdamW's `exp_avg`, `exp_avg_sq` and `step` make it across; buffers do
not (DeepSpeed's universal load keeps the buffers the model was built with; they are written
to the model-state file's `module` for reference), nor does a learning-rate scheduler's state
(shardc keeps none) or a loss scaler (shardc trains in fp32). It reads the DCP directory one
tensor at a time, so no process holds the whole model's optimizer state at once.
"""
from __future__ import annotations

import os

from shardc.dsl.errors import ShardcError

__all__ = ["dcp_to_deepspeed"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _meta(src: str):
    import torch.distributed.checkpoint as dcp
    if not os.path.isdir(src):
        raise ShardcError(f"shardc checkpoint {src} is not a directory")
    try:
        return dcp.FileSystemReader(src).read_metadata().state_dict_metadata
    except Exception as e:                                  # noqa: BLE001 — one sentence
        raise ShardcError(f"shardc checkpoint {src} is not a DCP checkpoint "
                          f"({type(e).__name__}: {e})") from None


def _read(src: str, keys: dict) -> dict:
    """`keys`: {DCP key: an empty tensor of its shape, or None for a non-tensor}; loaded, one process."""
    import torch.distributed.checkpoint as dcp
    sd = dict(keys)
    dcp.load(sd, checkpoint_id=src, no_dist=True)
    return sd


def dcp_to_deepspeed(src: str, dst: str, tag: str = "from_shardc") -> list[str]:
    """Write the shardc DCP checkpoint `src` as a DeepSpeed universal checkpoint `dst/<tag>`
    (and `dst/latest_universal`), loaded by `engine.load_checkpoint(dst)` with
    `"checkpoint": {"load_universal": true}`. Parameters in fp32 and AdamW's `exp_avg`,
    `exp_avg_sq` and `step` go across; one process, no process group. Returns the parameter
    names. See [Note: what the universal layout holds]."""
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = _meta(src)
    groups = sorted({k.split(".")[2] for k in meta if k.startswith("optim.param_groups.")})
    if len(groups) != 1:
        raise ShardcError(f"shardc checkpoint {src} has {len(groups) or 'no'} optimizer param "
                          f"groups; DeepSpeed's universal checkpoint is written for exactly one")
    hyper = _read(src, {k: None for k in meta if k.startswith("optim.param_groups.0.")})
    names = hyper.pop("optim.param_groups.0.params", None)
    hyper = {k[len("optim.param_groups.0."):]: v for k, v in hyper.items()}
    if not isinstance(names, list):
        # DCP flattens the group's name list into optim.param_groups.0.params.<j>
        names = [hyper.pop(f"params.{j}") for j in range(sum(k.startswith("params.") for k in hyper))]
    tensors = {k: v for k, v in meta.items() if isinstance(v, TensorStorageMetadata)}
    missing = [n for n in names if f"model.{n}" not in tensors]
    if missing:
        raise ShardcError(f"shardc checkpoint {src} has no tensor model.{missing[0]} for the "
                          f"optimizer's parameter {missing[0]!r}")
    tagdir = os.path.join(dst, tag)
    zero = os.path.join(tagdir, "zero")
    steps = set()
    for n in names:
        keys = {f"model.{n}": tensors[f"model.{n}"]}
        keys.update({f"optim.state.{n}.{m}": tensors[f"optim.state.{n}.{m}"] for m in _MOMENTS
                     if f"optim.state.{n}.{m}" in tensors})
        if len(keys) != 1 + len(_MOMENTS):
            raise ShardcError(f"shardc checkpoint {src} holds no AdamW exp_avg/exp_avg_sq for "
                              f"parameter {n!r} (saved before the first step, or not AdamW)")
        step_key = f"optim.state.{n}.step"
        got = _read(src, {**{k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in keys.items()},
                          **({step_key: _empty(meta[step_key])} if step_key in meta else {})})
        os.makedirs(os.path.join(zero, n), exist_ok=True)
        torch.save({"param": got[f"model.{n}"].float()}, os.path.join(zero, n, "fp32.pt"))
        for m in _MOMENTS:
            torch.save({"param": got[f"optim.state.{n}.{m}"].float()}, os.path.join(zero, n, f"{m}.pt"))
        step = got.get(step_key)
        if step is not None:
            step = float(step.item() if torch.is_tensor(step) else step)
            steps.add(step)
            torch.save(torch.tensor(step), os.path.join(zero, n, "step.pt"))
    if len(steps) > 1:
        raise ShardcError(f"shardc checkpoint {src} holds parameters at different AdamW steps "
                          f"{sorted(steps)}; DeepSpeed keeps one step per param group")
    step = steps.pop() if steps else 0.0
    torch.save({"ds_version": _ds_version(), "param_groups": [dict(hyper)],
                "optimizer_state_dict": {"state": {0: {"step": torch.tensor(step)}},
                                         "param_groups": [dict(hyper)]}},
               os.path.join(zero, "optimizer_state.pt"))
    buffers = [k for k, v in tensors.items() if k.startswith("model.") and k[6:] not in names]
    module = _read(src, {k: torch.empty(tensors[k].size, dtype=tensors[k].properties.dtype)
                         for k in buffers}) if buffers else {}
    states = {"module": {k[6:]: v for k, v in module.items()}, "buffer_names": [k[6:] for k in buffers],
              "param_shapes": [{n: torch.Size(tensors[f"model.{n}"].size) for n in names}],
              "dp_world_size": 1, "mp_world_size": 1, "global_steps": int(step), "skipped_steps": 0,
              "lr_scheduler": None, "ds_version": _ds_version()}
    # stage 1/2 read mp_rank_00_*, stage 3 zero_pp_rank_0_mp_rank_00_* (the universal load's pp 0)
    for f in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        torch.save(states, os.path.join(tagdir, f))
    with open(os.path.join(dst, "latest_universal"), "w") as f:
        f.write(tag)
    return names


def _empty(md):
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    return torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None


def _ds_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "0.19.8"             # the version this layout was checked against (docs/deepspeed.md)
