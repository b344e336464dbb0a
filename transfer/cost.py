"""Direct or staged? A two-term cost model per request.

    direct = ranges x per_range + bytes / link
    staged = bytes / link + bytes / copy + chunks x per_chunk     (gather and scatter overlap
                                                                   the write; count them once)

per_range and link are the link's (its transport measured them); copy and per_chunk ours.
"""

from transfer.config import Mode, TransferConfig
from transfer.plan import TransferPlan
from transfer.transports.base import LinkCost


def estimate(plan: TransferPlan, cost: LinkCost, config: TransferConfig, slot_bytes: int) -> dict[Mode, float]:
    nbytes = sum(c.nbytes for c in plan.body)
    ranges = sum(c.num_ranges for c in plan.body)
    chunks = -(-nbytes // slot_bytes) if slot_bytes else 0
    link, copy = cost.link_gbps * 1e9, config.copy_gbps * 1e9
    return {
        Mode.DIRECT: ranges * cost.per_range_us * 1e-6 + nbytes / link,
        Mode.STAGED: nbytes / link + nbytes / copy + chunks * config.per_chunk_us * 1e-6,
    }


def choose_mode(plan: TransferPlan, cost: LinkCost, config: TransferConfig, slot_bytes: int,
                staging_available: bool) -> Mode:
    """DIRECT when configured or when the receiver lent no staging slots (all in use by other
    transfers: a request never fails for want of a slot); STAGED when configured; for AUTO the
    cheaper estimate."""
    if config.mode is Mode.DIRECT or not staging_available or not plan.body:
        return Mode.DIRECT
    if config.mode is Mode.STAGED:
        return Mode.STAGED
    est = estimate(plan, cost, config, slot_bytes)
    return Mode.STAGED if est[Mode.STAGED] < est[Mode.DIRECT] else Mode.DIRECT
