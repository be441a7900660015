"""`collectives ho-ring` — PaRO's HO-Ring (§3.3): the hierarchical stages, pipelined over
pieces of the chunk so that one piece's intra-level stage and another's inter-level stage
run at once."""
from .base import register
from .hierarchical import Hierarchical


@register
class HORing(Hierarchical):
    name = "ho-ring"
    pieces = 4          # the runtime issues this many chains; the cost model pays a latency per piece and stage
