"""A collective's handle — stage: runtime (eager). The pieces of one collective
(runtime/eager/collectives.py: generators that issue async torch.distributed ops and yield
their handles) driven to the end.

Input: the pieces, a post-processing callable, the call's communication stream.
Output: `Work`, whose `wait()` completes the collective; `local_copy` for a group of one.

[Note: stages and handles]
This executor runs an algorithm's stages as generators ("pieces") that issue async
torch.distributed ops and yield the handles the next stage depends on. `Work` starts every
piece at once (so the first stage of every piece is in flight when the call returns) and
`wait()` drives them round-robin: piece k's next stage is issued as soon as its previous
stage is done, while the other pieces' stages are still in flight (an algorithm with
`pieces` > 1, HO-Ring, has an intra-level stage of one piece and an inter-level stage of
another in flight together). Later stages are issued from `wait()` in the caller's thread,
never from a helper thread: collectives on a group must be issued in the same order on
every rank, which the caller's program order guarantees. `wait()` must be called before
reading the result.

[Note: streams]
Every call runs on a communication stream of its kind where the device has streams
(`device.launch`, see runtime/transport/device.py "communication streams"): the body (casts,
quantization, the first stage) is issued inside `on.active()`, `Work.wait()` drives the
later stages and the post-processing there too, then joins the caller's stream. The
trivial cases (no level of size > 1) copy on the caller's stream and return done work.
"""
from __future__ import annotations

import torch

from ..transport import device


class Work:
    """Handle of a (possibly multi-stage) collective; `wait()` completes it."""

    __slots__ = ("_pending", "_then", "_on")

    def __init__(self, *pieces, then=None, on=device.NO_STREAM):
        self._pending = []
        self._then = then                       # local post-processing once every piece is done
        self._on = on                           # the comm stream (see [Note: streams])
        with on.active():
            for g in pieces:
                self._advance(g)

    def _advance(self, gen) -> None:
        try:
            self._pending.append((gen, next(gen)))
        except StopIteration:
            pass

    def wait(self) -> bool:
        with self._on.active():
            while self._pending:
                current, self._pending = self._pending, []
                for gen, works in current:
                    for w in works:
                        w.wait()
                    self._advance(gen)
            if self._then is not None:
                then, self._then = self._then, None
                then()
        self._on.join()
        return True

    def is_completed(self) -> bool:
        return not self._pending and self._then is None


def local_copy(out: torch.Tensor, inp: torch.Tensor) -> Work:
    """The collective over a group of one rank: `inp` into `out` (nothing when they are one)."""
    if out.data_ptr() != inp.data_ptr():
        out.copy_(inp.reshape(out.shape))
    return Work()
