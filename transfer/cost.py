"""Direct, staged or gathered? A two-term cost model per request.

    direct   = ranges x per_range + bytes / link
    staged   = bytes / link + bytes / copy + chunks x per_chunk   (gather and scatter overlap
                                                                   the write; count them once)
    gathered = gathered ranges x per_range + bytes / link + bytes / copy

A send that can go gathered (transfer.gathered: the receiver's rows whole, the pool in host
memory) does the staged work less the scatter, the notices and the acks, and needs no
receiver slot: it is weighed against direct only, staged stays for where it is configured.

per_range and link are the link's (its transport measured them); copy and per_chunk ours.

Layer-wise streaming cuts a request into layer groups: the more groups, the less is left to
send when the last layer is final (that part is what decode waits for after compute), but
each group is at least one more write. `layer_bounds` makes as many groups as the layers
allow while each group still takes `stream_group_ms` on the link, so fixed costs per write (a
chunk's round trip, a kernel launch) stay a small share.
"""

from transfer.config import Mode, TransferConfig
from transfer.plan import TransferPlan
from transfer.transports.base import LinkCost


def estimate(
    plan: TransferPlan, cost: LinkCost, config: TransferConfig, slot_bytes: int, gathered_ranges: int | None = None
) -> dict[Mode, float]:
    """Seconds per mode (GATHERED where `gathered_ranges`, its range count, is given)."""
    nbytes = sum(c.nbytes for c in plan.body)
    ranges = sum(c.num_ranges for c in plan.body)
    chunks = -(-nbytes // slot_bytes) if slot_bytes else 0
    link, copy = cost.link_gbps * 1e9, config.copy_gbps * 1e9
    est = {
        Mode.DIRECT: ranges * cost.per_range_us * 1e-6 + nbytes / link,
        Mode.STAGED: nbytes / link + nbytes / copy + chunks * config.per_chunk_us * 1e-6,
    }
    if gathered_ranges is not None:
        est[Mode.GATHERED] = gathered_ranges * cost.per_range_us * 1e-6 + nbytes / link + nbytes / copy
    return est


def choose_mode(
    plan: TransferPlan,
    cost: LinkCost,
    config: TransferConfig,
    slot_bytes: int,
    staging_available: bool,
    gathered_ranges: int | None = None,
) -> Mode:
    """DIRECT when configured; STAGED when configured and the receiver lent staging slots,
    else DIRECT (a request never fails for want of a slot); GATHERED when configured and the
    send can go so (`gathered_ranges`, transfer.gathered), else as AUTO. AUTO: where the send
    can go gathered, the cheaper of GATHERED and DIRECT; else the cheaper of STAGED (when
    slots were lent) and DIRECT."""
    if config.mode is Mode.DIRECT or not plan.body:
        return Mode.DIRECT
    if config.mode is Mode.STAGED:
        return Mode.STAGED if staging_available else Mode.DIRECT
    if config.mode is Mode.GATHERED and gathered_ranges is not None:
        return Mode.GATHERED
    est = estimate(plan, cost, config, slot_bytes, gathered_ranges)
    if gathered_ranges is not None:
        return Mode.GATHERED if est[Mode.GATHERED] < est[Mode.DIRECT] else Mode.DIRECT
    if not staging_available:
        return Mode.DIRECT
    return Mode.STAGED if est[Mode.STAGED] < est[Mode.DIRECT] else Mode.DIRECT


def layer_bounds(num_layers: int, nbytes: int, cost: LinkCost, config: TransferConfig) -> list[int]:
    """Bounds of the layer groups a streamed request is sent in: [0, ..., num_layers], the
    layers split as evenly as they go; one group when the request is too small to pay."""
    seconds = nbytes / (cost.link_gbps * 1e9)
    groups = max(1, min(num_layers, int(seconds / (config.stream_group_ms * 1e-3))))
    return [num_layers * g // groups for g in range(groups + 1)]


def streams_well(device: str, link) -> bool:
    """Whether writes from a pool on `device` over `link` may run while the model engine
    computes (layer-wise streaming, `auto`): from host memory always; from a CUDA pool only
    over a link whose writes leave the engine's kernels alone (Link.overlaps_gpu_compute)."""
    return not device.startswith("cuda") or link.overlaps_gpu_compute
