"""Schedule — part of stage 3 (lowering): which gathers are issued before which unit runs.

Input: the units in forward order (root first), which of them are gathered (s_P > 1),
the strategy's `prefetch` k. Output: a `Schedule` — forward and backward stages.

[Note: prefetch]
Let G be the gathered non-root units in forward order. Forward: the root's stage issues
the root's own gather (when gathered) and G[0..k); the stage of G[j] issues G[j+k] — so
k gathers are in flight while a unit computes. With k = 0 every unit issues its own
gather right before it runs. Backward walks G reversed (B): B[0]'s stage issues B[0]
and B[1..k]; the stage of B[j] issues B[j+k]. A unit's gather is waited right after its
stage's issues, then it runs. Ungathered units get empty stages.
"""
from __future__ import annotations

from .ir import Schedule, Stage


def _stages(order: list[int], gathered: list[int], k: int, first: tuple[int, ...]) -> list[Stage]:
    out, pos = [], {u: j for j, u in enumerate(gathered)}
    for u in order:
        j = pos.get(u)
        if j is None:
            out.append(Stage(u))
        elif k == 0:
            out.append(Stage(u, (u,)))
        else:
            ahead = gathered[j + k:j + k + 1] if (j or first) else gathered[:1 + k]
            out.append(Stage(u, tuple(ahead)))
    return out


def schedule(gathered: list[bool], prefetch: int) -> Schedule:
    """`gathered[i]`: unit i (forward order, 0 = root) is gathered before it runs."""
    k = max(0, prefetch)
    rest = [i for i in range(1, len(gathered))]
    fwd_g = [i for i in rest if gathered[i]]
    root_issue = ((0,) if gathered and gathered[0] else ()) + tuple(fwd_g[:k])
    forward = [Stage(0, root_issue)] + _stages(rest, fwd_g, k, first=(0,)) if gathered else []
    bwd = list(reversed(rest))
    backward = _stages(bwd, list(reversed(fwd_g)), k, first=())
    return Schedule(tuple(forward), tuple(backward))
