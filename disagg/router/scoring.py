"""Which pair a request goes to, KV-aware (`--route kv`): a pure function of what the router
knows of each candidate, so it is tested without a process.

A pair's cost, in prompt tokens:

    cost = (n - decode_cached) + (n - prefill_cached)        the work this request adds there:
                                                               KV to move, prompt to compute
         + weight * (inflight + short)                        its load: prompt tokens queued and
                                                               running on its two instances, and
                                                               what its decode lacks of free
                                                               pages for this one

`decode_cached` is the longest prefix of the prompt every decode rank holds (a rank's cache
is its own under TP; the slowest rank bounds the transfer), `prefill_cached` the same of a
prefill that caches (0 where none does). `inflight` is the prefill instance's load plus the
decode instance's, each as the router believes it (disagg/router/load.py): this router's own
requests there now (a burst it sent since the last report is not missed, one that ended
counts no more) plus what the instance's last /health report held beyond them (other
routers' requests, up to a probe round old: what another router keeps busy is seen). Both instances of a pair count their load whole,
so when every prefill is paired with every decode (--pair P,D for each), the cheapest pair is
the cheapest prefill with the cheapest decode: the two are chosen independently. The weight
(`--kv-load-weight`) trades reuse for balance: 0 routes by reuse alone; a large one by load
alone. Ties go to the first candidate at or after `start` in their order, and the router moves
`start` on only after a tie (`tied`), so with nothing cached and nothing in flight (every new
conversation) the choice is round robin, whatever went by its cache in between.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """What the router knows of one pair that is up."""

    decode_cached: int = 0  # prompt tokens its decode holds (every rank), 0..n
    prefill_cached: int = 0  # prompt tokens its prefill holds (0: none cached)
    inflight: int = 0  # prompt tokens queued and running on its prefill and decode (their load)
    free: "int | None" = None  # tokens its decode can take now (None: not known)


def cost(c: Candidate, n: int, weight: float) -> float:
    """The cost above for a prompt of n tokens."""
    short = 0 if c.free is None else max(0, n - c.decode_cached - c.free)
    return (n - c.decode_cached) + (n - c.prefill_cached) + weight * (c.inflight + short)


def choose(candidates: list[Candidate], n: int, weight: float, start: int = 0) -> int:
    """The index of the cheapest candidate; ties: the first at or after `start` (mod len)."""
    if not candidates:
        raise ValueError("no candidate to choose from")
    k = len(candidates)
    order = [(start + i) % k for i in range(k)]
    return min(order, key=lambda i: cost(candidates[i], n, weight))


def tied(candidates: list[Candidate], n: int, weight: float) -> bool:
    """More than one candidate at the lowest cost (the choice was the turn's, not the cost's)."""
    costs = [cost(c, n, weight) for c in candidates]
    return costs.count(min(costs)) > 1
