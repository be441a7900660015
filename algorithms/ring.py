"""`collectives ring` — one flat collective over the whole group (NCCL's and gloo's own)."""
from .base import Algorithm, ReducePlan, register


@register
class Ring(Algorithm):
    """Every collective is one stage over the group positioned by the chunk order."""
    name = "ring"

    def gather(self, key, ordered):
        return (key,)

    def scatter(self, key, ordered):
        return (key,)

    def reduce(self, key, ordered):
        return ReducePlan((), key, ())
