"""`collectives hierarchical` — H-Ring: one ring per level, so outer links carry 1/inner of
the data (all-gather outermost level first, reduce-scatter innermost first; an all-reduce
reduce-scatters the inner levels, all-reduces the outermost, all-gathers back)."""
from .base import Algorithm, ReducePlan, register


@register
class Hierarchical(Algorithm):
    name = "hierarchical"

    def gather(self, key, ordered):
        return tuple((lvl,) for lvl in ordered(key))

    def scatter(self, key, ordered):
        return tuple((lvl,) for lvl in reversed(ordered(key)))

    def reduce(self, key, ordered):
        levels = ordered(key)
        inner = tuple((lvl,) for lvl in levels[1:])
        return ReducePlan(tuple(reversed(inner)), (levels[0],), inner)
