"""Peak probe — which tensors are alive at a simulated rank's measured peak, and where they
were made. Runs `shardc.simulate.simulate_rank` in this process with torch's MemTracker
extended to remember each storage's allocation site (the innermost frame in shardc's
runtime, else the model's code) and, at each phase's peak, the live storages by site.

    python bench/peak_probe.py [--phase backward] STRATEGY.shard --model PATH.py:FACTORY --world 4 --mesh "node(2) > gpu(2)" --tokens 64

A diagnostic for the memory timeline (analysis/costmodel/timeline.py): each site's bytes
beside the timeline's buffers at the same phase. Slow (a stack walk per storage): tiny models only.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import traceback

def _site() -> str:
    frames = traceback.extract_stack()[:-3]
    for want in ("/runtime/", "/shardc/simulate.py", "torch/optim/", "/transformers/", "/examples/", "torch/nn/"):
        for f in reversed(frames):
            if want in f.filename and "mem_tracker" not in f.filename:
                return f"{f.filename.split('/')[-2]}/{f.filename.split('/')[-1]}:{f.lineno} {f.name}"
    return "autograd (no python frame)"


def probing(make):
    """(a tracker factory like `make` (shardc/simulate.py `_step_tracker`) whose instances
    remember, at each phase's peak, the live storages by allocation site; {phase: (bytes,
    {site: bytes})}, filled as the tracker runs). Patches MemTracker's storage records."""
    from torch.distributed._tools import mem_tracker as mt
    sites: dict[int, str] = {}
    orig = mt._WeakRefInfo.create_winfo.__func__

    def create_winfo(cls, st, device, reftype, callback=None):
        w, ref = orig(cls, st, device, reftype, callback)
        sites[id(w)] = f"{reftype.value}: {_site()}"
        return w, ref
    mt._WeakRefInfo.create_winfo = classmethod(create_winfo)
    found: dict[str, tuple[int, dict]] = {}

    def tracker():
        t = make()
        cls = type(t)
        base_update, base_phase = cls._update_peak_stats, cls.phase
        cur = {"name": None}

        def record(self):
            live = collections.Counter()
            for _st, (w, _r) in list(self._WINFO.items()):
                live[sites.get(id(w), f"{w.reftype.value}: registered before the step")] += w.mem_consumed
            total = sum(self._peak_mem.values())
            if total >= found.get(cur["name"], (-1, None))[0]:
                found[cur["name"]] = (total, dict(live))

        def update(self, peak_state):
            before = dict(self._peak_mem)
            base_update(self, peak_state)
            if self._peak_mem != before and cur["name"]:
                record(self)

        @contextlib.contextmanager
        def phase(self, name):
            cur["name"] = name
            with base_phase(self, name):
                record(self)              # a phase whose peak is where it starts
                yield
        cls._update_peak_stats, cls.phase = update, phase
        return t
    return tracker, found


def main() -> None:
    import sys
    import shardc.simulate as sim
    ap = argparse.ArgumentParser()
    ap.add_argument("--phase", help="print this phase only")
    a, rest = ap.parse_known_args()
    sim._step_tracker, found = probing(sim._step_tracker)

    import io
    from shardc.cli import main as cli
    buf, out = io.StringIO(), sys.stdout
    sys.stdout = buf
    try:
        cli(["simulate", *rest, "--rank", "0", "--json"])
    except SystemExit:
        pass
    finally:
        sys.stdout = out
    import json
    p = json.loads(buf.getvalue())[0]["peak"]
    tl = {x["phase"]: x for x in p["explain_timeline"]}
    for name, (total, live) in found.items():
        if a.phase and name != a.phase:
            continue
        print(f"== {name}: measured {total:,}  explain {tl.get(name, {}).get('bytes', 0):,}")
        for k, v in sorted(live.items(), key=lambda kv: -kv[1]):
            if v:
                print(f"   {v:>12,}  {k}")
        for k, v in (tl[name]["buffers"] if name in tl else {}).items():
            print(f"   explain {v:>12,}  {k}")


if __name__ == "__main__":
    main()
