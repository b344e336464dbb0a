"""PoolSettings: the pool flags both workers share, turned into a kvpool PoolConfig."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.layout import Layout
from kvpool.presets import get_preset
from kvpool.spec import ModelSpec

if TYPE_CHECKING:
    from kvpool.config import PoolConfig


@dataclass(frozen=True)
class PoolSettings:
    preset: str = "tiny-hybrid"
    page_size: int | None = None  # None: the preset's default
    max_tokens: int | None = 65536
    byte_budget: int | None = None
    max_requests: int = 64
    layout: str = "page_major"
    device: str = "auto"
    tp_size: int = 1  # ranks of this instance; the pool holds rank tp_rank's heads
    tp_rank: int = 0
    swa_share: float | None = None  # SWA pages as a share of full pages; None: the role's default

    def resolved_device(self) -> str:
        """--device auto -> cuda where torch sees a GPU, else cpu (the pool's own rule)."""
        from kvpool.config import resolve_device  # imports torch: not for --help

        return resolve_device(self.device)

    def pool_config(self, model: ModelSpec | None = None, swa_window_only: bool = False) -> "PoolConfig":
        """The pool of this preset, or of `model` (the geometry a model engine read off its
        model's cache). SWA pages, unless --swa-share says: as many as full pages where a
        request holds every SWA page (prefill computes the whole prompt: a prompt that fits
        the full pool fits the SWA pool), half where it holds the window only (decode)."""
        from kvpool.config import PoolConfig

        model = model or get_preset(self.preset)
        share = self.swa_share or (0.5 if swa_window_only else 1.0)
        return PoolConfig(
            model,
            self.page_size or model.default_page_size,
            max_tokens=self.max_tokens,
            byte_budget=self.byte_budget,
            max_requests=self.max_requests,
            layout=Layout(self.layout),
            device=self.device,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            swa_ratio=share,
        )


def memory(config: "PoolConfig", staging_bytes: int = 0) -> dict:
    """What a pool of `config` will take, per component (computed before it is allocated, so a
    person sees the size before the memory is gone): bytes, and one line for the log."""
    from disagg.checks import human_bytes

    sizes = config.sizes()
    parts = {c.value: config.row_bytes(c) * sizes.num_items(c) for c in config.components}
    total = sum(parts.values()) + staging_bytes
    items = ", ".join(f"{name} {human_bytes(n)}" for name, n in parts.items())
    staging = f", staging {human_bytes(staging_bytes)}" if staging_bytes else ""
    return {
        "bytes": total,
        "human": human_bytes(total),
        "device": str(config.device),
        "components": parts,
        "line": f"{human_bytes(total)} on {config.device} ({items}{staging}); {sizes.full_pages} pages of "
        f"{config.page_size} tokens, {config.max_requests} request slots",
    }
