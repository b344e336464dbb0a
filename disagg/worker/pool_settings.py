"""PoolSettings: the pool flags both workers share, turned into a kvpool PoolConfig."""

from dataclasses import dataclass

from kvpool import Layout, ModelSpec, PoolConfig, get_preset, resolve_device


@dataclass(frozen=True)
class PoolSettings:
    preset: str = "tiny-hybrid"
    page_size: int | None = None        # None: the preset's default
    max_tokens: int | None = 65536
    byte_budget: int | None = None
    max_requests: int = 64
    layout: str = "page_major"
    device: str = "auto"

    def resolved_device(self) -> str:
        """--device auto -> cuda where torch sees a GPU, else cpu (the pool's own rule)."""
        return resolve_device(self.device)

    def pool_config(self, model: ModelSpec | None = None) -> PoolConfig:
        """The pool of this preset, or of `model` (the geometry a model engine read off its
        model's cache)."""
        model = model or get_preset(self.preset)
        return PoolConfig(model, self.page_size or model.default_page_size, max_tokens=self.max_tokens,
                          byte_budget=self.byte_budget, max_requests=self.max_requests,
                          layout=Layout(self.layout), device=self.device)
