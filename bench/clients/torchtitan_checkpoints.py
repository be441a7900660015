"""The checkpoint checks of bench/clients/torchtitan_check.py (bench stage: args -> one result dict
per check; information only): `dcp-save`, `dcp-resume`, `fsdp2` (FSDP2 saved and resumed
torchtitan's way, against shardc both ways) and `torch-save` (`dcp_to_torch_save` into
the plain model). torchtitan_check.py's docstring says what each asserts.
"""
from __future__ import annotations

import os
import time

from titan_common import OPTIMS, error, get_rank, get_world, make_opt, plain, rel_err, say, tol, two_level, verdict
from titan_llama import fmt, batches, bit_equal, build, optim_err, references, sharded, train


def _torch_recipe_save(model, opt, path, flatten=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=flatten))
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _torch_recipe_load(model, opt, path, flatten=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)
    msd, osd = get_state_dict(model, opt, options=options)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options)


def _sm_state(sm, opt) -> tuple[dict, dict]:
    return plain(sm.full_state_dict()), {n: plain(st) for n, st in sm.full_optim_state_dict(opt)["state"].items()}


def _same(got: tuple[dict, dict], saved: tuple[dict, dict]) -> bool:
    """Parameters (state-dict keys) and optimizer states bit for bit."""
    (gp, gs), (sp, ss) = got, saved
    return bit_equal(gp, sp) and set(gs) == set(ss) and all(_same_state(gs[n], ss[n]) for n in ss)


def _same_state(got: dict, saved: dict) -> bool:
    """One parameter's optimizer state: tensors bit for bit, `step` by value."""
    import torch
    if set(got) != set(saved):
        return False
    for k, v in saved.items():
        g = got[k]
        if k == "step" or not isinstance(v, torch.Tensor) or v.dim() == 0:
            if float(g) != float(v):
                return False
        elif not torch.equal(g, v):
            return False
    return True


def _against(got: tuple[dict, dict], want: tuple[dict, dict], floor: tuple[float, float]) -> dict:
    (gp, gs), (wp, ws) = got, want
    p = rel_err(gp, wp)[0] if list(gp) == list(wp) else float("inf")
    m, steps_ok = optim_err(gs, ws)
    return dict(params=p, moments=m, steps_equal=steps_ok, floor_params=floor[0], floor_moments=floor[1],
                ok=p <= tol(floor[0]) and m <= tol(floor[1]) and steps_ok)


def check_dcp_save(args) -> dict:
    import torch
    world, rank = get_world(), get_rank()
    mesh = two_level(world)
    sm = sharded(args, "zero3", mesh, seed=0)
    opt = make_opt("adamw", sm.parameters())
    train(sm, opt, batches(args, args.steps), rank, world)
    path = os.path.join(args.dir, "shardc_zero3")
    t0 = time.perf_counter()
    _torch_recipe_save(sm, opt, path)
    r = dict(mesh=mesh, world=world, save_s=time.perf_counter() - t0)
    saved = _sm_state(sm, opt)
    if rank == 0:                                   # what the resume must hold after its load, bit for bit
        torch.save(dict(state=saved, world=world), path + ".full.pt")
    ref, floor = references(args, "adamw", args.steps, world=world)
    r["at_save"] = _against(saved, ref[args.steps], floor[args.steps])
    r["ok"] = r["at_save"]["ok"]
    say(f"dcp-save zero3 on {mesh} ({world} ranks): {args.steps} AdamW steps, get_state_dict + dcp.save "
        f"into {path} in {r['save_s']:.2f} s; against the reference: {fmt(r['at_save'])}  {verdict(r['ok'])}")
    return r


def check_dcp_resume(args) -> dict:
    import torch
    world, rank = get_world(), get_rank()
    mesh = two_level(world)
    path = os.path.join(args.dir, "shardc_zero3")
    saved = torch.load(path + ".full.pt")
    ref, floor = references(args, "adamw", 2 * args.steps, marks=(args.steps,), world=world)
    sm = sharded(args, "paro_iig", mesh, seed=100 + rank)
    opt = make_opt("adamw", sm.parameters())
    t0 = time.perf_counter()
    _torch_recipe_load(sm, opt, path)
    r = dict(mesh=mesh, world=world, saved_world=saved["world"], load_s=time.perf_counter() - t0)
    r["after_load_bit_equal_to_save"] = _same(_sm_state(sm, opt), saved["state"])
    t0 = time.perf_counter()
    train(sm, opt, batches(args, args.steps, args.steps), rank, world)
    r["train_s"] = time.perf_counter() - t0
    r["after_resume"] = _against(_sm_state(sm, opt), ref[2 * args.steps], floor[2 * args.steps])
    r["ok"] = r["after_load_bit_equal_to_save"] and r["after_resume"]["ok"]
    say(f"dcp-resume paro_iig on {mesh} ({world} ranks) from zero3 at {saved['world']} ranks ({path}): "
        f"get_state_dict + dcp.load + set_state_dict {r['load_s']:.2f} s; params and AdamW state bit-equal to "
        f"the saved run's: {r['after_load_bit_equal_to_save']}; after {args.steps} more steps "
        f"({r['train_s']:.1f} s) against the uninterrupted {2 * args.steps}-step run: {fmt(r['after_resume'])}  "
        f"{verdict(r['ok'])}")
    return r


def _fsdp2(args, seed):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = build(args, seed)
    mesh = init_device_mesh("cpu", (get_world(),), mesh_dim_names=("dp_shard",))
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    cls, kw = OPTIMS["adamw"]
    opt = getattr(torch.optim, cls)(model.named_parameters(), **kw)   # torchtitan builds it with names
    return model, opt


def _fsdp2_save(model, opt, path):
    """torchtitan's checkpointer: `ModelWrapper.state_dict()` (= model.state_dict(), hooks
    and all) and `OptimizersContainer.state_dict()` (its flat FQN-keyed optimizer dict)."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer.utils import get_flat_optim_state_dict, init_optim_state
    init_optim_state(opt)
    dcp.save({"model": ModelWrapper(model).state_dict(), "optim": get_flat_optim_state_dict(opt)},
             checkpoint_id=path)


def _fsdp2_load(model, opt, path):
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper
    from torchtitan.components.optimizer.utils import (get_flat_optim_state_dict, init_optim_state,
                                                        load_flat_optim_state_dict)
    wrapper = ModelWrapper(model)
    init_optim_state(opt)
    state = {"model": wrapper.state_dict(), "optim": get_flat_optim_state_dict(opt)}
    dcp.load(state, checkpoint_id=path)
    wrapper.load_state_dict(state["model"])                          # model.load_state_dict(strict=False)
    load_flat_optim_state_dict(opt, state["optim"])


def _fsdp2_state(model, opt) -> tuple[dict, dict]:
    params = plain(model.state_dict())
    names = {id(p): n for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
    return params, {names[id(p)]: plain(st) for p, st in opt.state.items()}


def check_fsdp2(args) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    world, rank = get_world(), get_rank()
    mesh = two_level(world)
    ref, floor = references(args, "adamw", 2 * args.steps, marks=(args.steps,), world=world)
    first, second = batches(args, args.steps), batches(args, args.steps, args.steps)
    end = (ref[2 * args.steps], floor[2 * args.steps])
    out = {}
    # FSDP2 -> shardc
    model, opt = _fsdp2(args, seed=0)
    train(model, opt, first, rank, world)
    saved = _fsdp2_state(model, opt)
    out["fsdp2_at_save"] = _against(saved, ref[args.steps], floor[args.steps])
    path = os.path.join(args.dir, "fsdp2_torchtitan")
    _fsdp2_save(model, opt, path)
    say(f"fsdp2 (1-D mesh of {world}) {args.steps} AdamW steps against the reference: {fmt(out['fsdp2_at_save'])}; "
        f"saved torchtitan's way into {path}")
    del model, opt
    r = out["fsdp2_to_shardc"] = {}
    for tag in ("model+optim", "model only"):
        sm = sharded(args, "paro_iig", mesh, seed=100 + rank)
        sopt = make_opt("adamw", sm.parameters())
        try:
            if tag == "model+optim":
                _torch_recipe_load(sm, sopt, path, flatten=True)
                c = dict(after_load_bit_equal_to_save=_same(_sm_state(sm, sopt), saved))
            else:
                state = {"model": get_model_state_dict(sm)}
                dcp.load(state, checkpoint_id=path)
                set_model_state_dict(sm, state["model"])
                c = dict(after_load_bit_equal_to_save=bit_equal(plain(sm.full_state_dict()), saved[0]))
            train(sm, sopt, second, rank, world)
            c.update(_against(_sm_state(sm, sopt), *end))
            if tag == "model only":                    # fresh moments: only the load itself counts
                c = dict(after_load_bit_equal_to_save=c["after_load_bit_equal_to_save"],
                         ok=c["after_load_bit_equal_to_save"])
            else:
                c["ok"] = c["ok"] and c["after_load_bit_equal_to_save"]
        except Exception as e:                          # noqa: BLE001 — reported, the other checks go on
            c = error(e)
        r[tag] = c
        say(f"fsdp2 -> shardc ({tag}: shardc paro_iig on {mesh} loads with get_state_dict(flatten_optimizer_"
            f"state_dict=True) + dcp.load + set_state_dict): {fmt(c)}  {verdict(c['ok'])}")
        del sm, sopt
        if c["ok"]:
            break
    # shardc -> FSDP2
    sm = sharded(args, "paro_iig", mesh, seed=0)
    sopt = make_opt("adamw", sm.parameters())
    train(sm, sopt, first, rank, world)
    path = os.path.join(args.dir, "shardc_for_fsdp2")
    try:
        _torch_recipe_save(sm, sopt, path, flatten=True)
        saved = _sm_state(sm, sopt)
        if rank == 0:                               # for --check torch-save
            import torch
            torch.save(dict(state=saved, world=world), path + ".full.pt")
        model, opt = _fsdp2(args, seed=5)
        _fsdp2_load(model, opt, path)
        c = dict(after_load_bit_equal_to_save=_same(_fsdp2_state(model, opt), saved))
        train(model, opt, second, rank, world)
        c.update(_against(_fsdp2_state(model, opt), *end))
        c["ok"] = c["ok"] and c["after_load_bit_equal_to_save"]
    except Exception as e:                              # noqa: BLE001
        c = error(e)
    out["shardc_to_fsdp2"] = c
    say(f"shardc -> fsdp2 (shardc paro_iig on {mesh} saves with get_state_dict(flatten_optimizer_state_dict="
        f"True) + dcp.save; FSDP2 loads torchtitan's way): {fmt(c)}  {verdict(c['ok'])}")
    out["ok"] = out["fsdp2_at_save"]["ok"] and out["shardc_to_fsdp2"]["ok"] and \
        any(v["ok"] for v in out["fsdp2_to_shardc"].values())
    return out


def check_torch_save(args) -> dict:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = {}
    for name in ("shardc_zero3", "shardc_for_fsdp2"):
        src = os.path.join(args.dir, name)
        if not os.path.isdir(src):
            continue
        dst = os.path.join(args.dir, f"{name}.pt")
        t0 = time.perf_counter()
        try:
            dcp_to_torch_save(src, dst)
            model = build(args, 9)
            res = model.load_state_dict(torch.load(dst)["model"], strict=True)
            got = plain(model.state_dict())
            r = dict(load=str(res), seconds=time.perf_counter() - t0)
            full = torch.load(src + ".full.pt")             # the saving run's own full_state_dict()
            r["bit_equal_to_saved_run"] = bit_equal(got, full["state"][0])
            world = full["world"]
            ref, floor = references(args, "adamw", args.steps, world=world)
            want = ref[args.steps][0]
            r.update(keys_equal=list(got) == list(want), max_rel_err=rel_err(got, want)[0],
                     floor=floor[args.steps][0])
            r["ok"] = r["keys_equal"] and r["max_rel_err"] <= tol(r["floor"]) and r["bit_equal_to_saved_run"]
        except Exception as e:                          # noqa: BLE001
            r = dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[:800]}", ok=False)
        out[name] = r
        print(f"torch-save {src} -> {dst}, load_state_dict(strict=True) into the plain model: {fmt(r)}  "
              f"{verdict(r['ok'])}", flush=True)
    if not out:
        print(f"torch-save: no shardc checkpoint under {args.dir} (run --check dcp-save first)", flush=True)
    out["ok"] = bool(out) and all(v["ok"] for v in out.values())
    return out
