"""The loss's tensors in the memory timeline — the one owner of the rule, by the logits' dtype.

Input: the trace's sizes (`flops.GraphCost`: `output`, the fp32 logits' bytes; `logits`, the
model's output in its own dtype; `head`, the root's parameters the forward uses after its
last unit) and the root's gradient element size from the plan. Output: `LossTensors`, the
bytes the loss adds at each of the timeline's points (timeline.py).

[Note: timeline: loss tensors]
The trace's activations are the units' saved tensors; the model's output (the logits) and the
loss are the loop's (shardc/simulate.py's step: `out`, `logits.float()`, cross entropy, which
saves its log-softmax; the loop drops `out` before `backward()`, [Note: the loop drops the
output before backward]). With L the logits' elements, b their element size, 4L the fp32
logits (`output`):
- the forward's end: the logits (bL), their fp32 copy where b != 4 (4L; `.float()` of an fp32
  tensor is itself) and the log-softmax (4L): 2 x output in fp32, 2.5 x in bf16;
- the loss's backward: nll_loss's gradient of the log-softmax (4L) and the log-softmax's
  gradient of the logits (4L) beside the saved log-softmax (4L): 3 x output in either dtype;
  then the cast back to b (bL) and the head's backward, which makes the head's parameters'
  gradients (`head` elements in the root's grad dtype) beside the logits' gradient (bL);
- from there to the root unit's reduce: the head's gradients only (every logits-sized tensor
  is freed once the head's backward ran); at the root's own points they are its autograd
  gradient already (timeline.py counts the unit's whole gradient there);
- where the root uses no parameter after its last unit (the head is a unit of its own), the
  logits' gradient (bL) goes into that unit's backward and is alive at all its points, to its
  reduce: bench/llama_zero3_units.shard on bench/peak_fsdp2.py's small HF Llama (vocab 8192,
  2 x 64 tokens, rank 0 of 8), 4,194,304 B of it beside the head's 8,388,608-byte gradient,
  explain 0.908 of the measured backward without it.
Measured with bench/peak_probe.py on a Llama of examples/llama.py's shape (dim 64, 2 blocks,
vocab 4096, 512 tokens; zero3, node(2) > gpu(2)), the live bytes by allocation site through
the backward, in bf16 and fp32: the loss's backward peaks at 3 x output exactly (25,165,824
B of loss tensors, both dtypes), the forward's loss at 2 x output (fp32) and 2.5 x (bf16:
16,781,320 + 4,194,304 B), and after the head's backward only the head's gradient stays
(524,288 B in bf16, 1,048,576 in fp32). The constants before (4 x output at the loss, 2 x
kept through the backward) were measured while the loop still held `out` through the
backward (4 = 3 + the fp32 logits) and, for the kept ones, on HF GPT-2 at 64 tokens, whose
tied head's gradient (V x D x 4 = 262,144 B) happened to be 2 x its logits: LLaMA-7B in bf16
at 64 and 128 GPUs was 3.3-3.9 % over the measured peak with them.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LossTensors:
    """Bytes per rank the loss adds at the timeline's points ([Note: timeline: loss tensors])."""
    forward: int     # at the forward's end: the logits, their fp32 copy, the log-softmax
    at_loss: int     # the backward's start: the loss's gradients beside the saved log-softmax
    kept: int        # from the head's backward to the root's reduce: the head's gradients
    last_unit: int   # through the last unit's backward where it makes the logits: their gradient


def loss_tensors(output: int, logits: int = 0, head_grad: int = 0) -> LossTensors:
    """`output`: the fp32 logits' bytes; `logits`: the model's output in its own dtype (0: the
    same as `output`, an fp32 model); `head_grad`: the gradients the head's backward makes
    (the root's parameters used after its last unit, in its grad dtype)."""
    logits = logits or output
    copy = output if logits != output else 0
    return LossTensors(forward=logits + copy + output,
                       at_loss=max(3 * output, logits + head_grad),
                       kept=head_grad, last_unit=0 if head_grad else logits)
