"""shardc.algorithms — collective algorithms, one object each (one file each).

Stage: below the DSL. Input: an algorithm's name (the strategy's `collectives` keyword).
Output: the `Algorithm` registered under it: the stages a collective runs over a group's
levels and how many pieces it pipelines (algorithms/base.py). The DSL checks names
against this registry, the cost model turns the stages into bytes per link level and
seconds, and both executors (the eager runtime, runtime/eager/collectives.py; the whole-step
mode's functional collectives, runtime/graph/funcol.py) run the same stages. A new algorithm is
one file defining an `Algorithm` subclass with `@register` and its import below: nothing
else names it. The registry is read-only after this package is imported; an algorithm of
a test or a user's experiment is registered for a scope, `with registered(cls): ...`
(algorithms/base.py [Note: a read-only registry]).
"""
from .base import AUTO, PROBE, RUN, Algorithm, ReducePlan, _seal, get, names, register, registered, resolve, stand_in

# the shipped algorithms register themselves; registration order breaks ties in `auto`
from . import hierarchical  # noqa: F401,E402,I001
from . import ring  # noqa: F401,E402
from . import ho_ring  # noqa: F401,E402

_seal()

__all__ = ["AUTO", "PROBE", "RUN", "Algorithm", "ReducePlan", "get", "names", "register", "registered", "resolve",
           "stand_in"]
