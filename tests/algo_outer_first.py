"""A test-only collective algorithm, `collectives outer-first`: the hierarchical stages in the
other order (reduce-scatter outermost level first, all-gather innermost first), so the outer
links carry the full volume. What adding an algorithm takes: this one file (tests/test_algorithms.py),
registered for a scope: `with registered(OuterFirst):` (the registry is read-only after import)."""
from shardc.algorithms import Algorithm, ReducePlan


class OuterFirst(Algorithm):
    name = "outer-first"

    def gather(self, key, ordered):
        return tuple((lvl,) for lvl in reversed(ordered(key)))

    def scatter(self, key, ordered):
        return tuple((lvl,) for lvl in ordered(key))

    def reduce(self, key, ordered):
        levels = ordered(key)
        outer = tuple((lvl,) for lvl in levels[:-1])
        return ReducePlan(outer, (levels[-1],), tuple(reversed(outer)))
