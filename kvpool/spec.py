r"""Typed description of a model's KV geometry (whole model, before any TP split).

A model is a list of layer indices grouped by kind. Each group has one geometry, so a
component pool can store one page of all its layers as one contiguous row:

    layer:  0    1    2    3    4    5  ...
    kind:   swa  full swa  full swa  full     (gpt-oss: even = SWA, odd = full)
            \_ SWA component: layers 0,2,4,..   \_ FULL component: layers 1,3,5,..

An NSA indexer rides on (a subset of) the full layers and shares their page indices; a
linear-attention (Mamba/GDN) layer keeps one constant-size state per request.
"""

from dataclasses import dataclass, field

from kvpool.dtypes import check as check_dtype
from kvpool.errors import SpecError


def _check_layers(what: str, layers: tuple[int, ...]) -> None:
    if not layers:
        raise SpecError(f"{what}: needs at least one layer")
    if len(set(layers)) != len(layers):
        raise SpecError(f"{what}: duplicate layer indices")
    if min(layers) < 0:
        raise SpecError(f"{what}: negative layer index")


def _check_positive(what: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value <= 0:
            raise SpecError(f"{what}: {name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class AttentionSpec:
    """MHA/GQA layers: K [kv_heads, k_dim] and V [kv_heads, v_dim] per token. Heads split by TP.
    With `window` set these are sliding-window layers (only the last `window` tokens matter)."""

    layers: tuple[int, ...]
    kv_heads: int
    k_dim: int
    v_dim: int
    dtype: str = "bfloat16"
    window: int | None = None

    def __post_init__(self) -> None:
        what = "swa" if self.window is not None else "full attention"
        _check_layers(what, self.layers)
        _check_positive(what, kv_heads=self.kv_heads, k_dim=self.k_dim, v_dim=self.v_dim)
        if self.window is not None and (not isinstance(self.window, int) or self.window <= 0):
            raise SpecError(f"swa: window must be a positive int, got {self.window!r}")
        check_dtype(self.dtype)


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention: one latent [latent_dim] per token and layer, replicated
    across TP ranks (DeepSeek: kv_lora_rank 512 + rope 64 = 576)."""

    layers: tuple[int, ...]
    latent_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        _check_layers("mla", self.layers)
        _check_positive("mla", latent_dim=self.latent_dim)
        check_dtype(self.dtype)


@dataclass(frozen=True)
class NSAIndexerSpec:
    """NSA indexer key cache: per token and layer `key_dim` quantized keys plus one scale per
    `scale_block` values, paged like the full layers it rides on. Replicated across TP."""

    layers: tuple[int, ...]
    key_dim: int = 128
    key_dtype: str = "float8_e4m3fn"
    scale_block: int = 128
    scale_dtype: str = "float32"

    def __post_init__(self) -> None:
        _check_layers("nsa", self.layers)
        _check_positive("nsa", key_dim=self.key_dim, scale_block=self.scale_block)
        if self.key_dim % self.scale_block:
            raise SpecError(f"nsa: key_dim {self.key_dim} not a multiple of scale_block {self.scale_block}")
        check_dtype(self.key_dtype)
        check_dtype(self.scale_dtype)


@dataclass(frozen=True)
class LinearStateSpec:
    """Mamba2 / gated-delta-net layers: per request a conv state [conv_dim, conv_width] and a
    temporal (SSM / recurrent) state [heads, d1, d2]. Heads split by TP; so do the conv
    channels, each of their groups on its own (`conv_groups`: (units, channels per unit) in
    channel order, e.g. Mamba2 [x | B | C] = ((heads, head_dim), (groups, d_state), (groups,
    d_state)); a GDN's [q | k | v] likewise). None: conv_dim units of one channel each.
    `tp_refusal`: why TP may not split this state at all (its channel groups are not known:
    a blind split would hand every rank the wrong channels); empty where it may.
    `conv_transposed`: the conv state is [conv_width, conv_dim] per slot (vLLM's default "SD"
    conv state layout: each of the width's columns holds every channel group's share), not
    [conv_dim, conv_width]."""

    layers: tuple[int, ...]
    conv_dim: int
    conv_width: int
    temporal_heads: int
    temporal_d1: int
    temporal_d2: int
    conv_dtype: str = "bfloat16"
    temporal_dtype: str = "float32"
    conv_groups: tuple[tuple[int, int], ...] | None = None
    tp_refusal: str = ""
    conv_transposed: bool = False

    def __post_init__(self) -> None:
        _check_layers("linear state", self.layers)
        if self.conv_groups is not None:
            groups = tuple(tuple(g) if isinstance(g, (tuple, list)) else (g,) for g in self.conv_groups)
            if not groups or any(len(g) != 2 or not all(isinstance(v, int) and v > 0 for v in g) for g in groups):
                raise SpecError(
                    f"linear state: conv_groups must be (units, channels) pairs of positive ints, "
                    f"got {self.conv_groups!r}"
                )
            if sum(u * ch for u, ch in groups) != self.conv_dim:
                raise SpecError(
                    f"linear state: conv_groups {groups} hold {sum(u * ch for u, ch in groups)} "
                    f"channels, conv_dim is {self.conv_dim}"
                )
            object.__setattr__(self, "conv_groups", groups)
        _check_positive(
            "linear state",
            conv_dim=self.conv_dim,
            conv_width=self.conv_width,
            temporal_heads=self.temporal_heads,
            temporal_d1=self.temporal_d1,
            temporal_d2=self.temporal_d2,
        )
        check_dtype(self.conv_dtype)
        check_dtype(self.temporal_dtype)

    @property
    def conv_layout(self) -> tuple[tuple[int, int], ...]:
        """(units, channels per unit) of the conv channels, in order (TP splits each group)."""
        return self.conv_groups or ((self.conv_dim, 1),)


@dataclass(frozen=True)
class ModelSpec:
    """KV geometry of one model. Layers not named by any group carry no KV (MLP-only)."""

    name: str
    num_layers: int
    full: AttentionSpec | MLASpec | None = None
    swa: AttentionSpec | None = None
    nsa: NSAIndexerSpec | None = None
    linear: LinearStateSpec | None = None
    default_page_size: int = 16
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _check_positive(self.name, num_layers=self.num_layers)
        if self.full is None and self.swa is None:
            raise SpecError(f"{self.name}: a model needs full or swa attention layers (pages index every component)")
        if isinstance(self.full, AttentionSpec) and self.full.window is not None:
            raise SpecError(f"{self.name}: full attention layers cannot have a window")
        if self.swa is not None and self.swa.window is None:
            raise SpecError(f"{self.name}: swa layers need a window")
        seen: dict[int, str] = {}
        for kind, group in (("full", self.full), ("swa", self.swa), ("linear", self.linear)):
            for layer in group.layers if group is not None else ():
                if layer >= self.num_layers:
                    raise SpecError(f"{self.name}: {kind} layer {layer} >= num_layers {self.num_layers}")
                if layer in seen and kind != "linear":  # K/V and a state side by side (falcon_h1): both
                    raise SpecError(f"{self.name}: layer {layer} is both {seen[layer]} and {kind}")
                seen[layer] = kind
        if self.nsa is not None:
            full_layers = set(self.full.layers) if self.full is not None else set()
            stray = sorted(set(self.nsa.layers) - full_layers)
            if stray:
                raise SpecError(f"{self.name}: nsa indexer on non-full layers {stray}")
        check_page_size(self.default_page_size)

    def layer_kinds(self) -> tuple[str, ...]:
        """Per layer: 'full', 'mla', 'swa', 'linear' or 'none' (no KV); a layer of attention
        and a linear state side by side is its attention kind (it is in `linear.layers` too)."""
        kinds = ["none"] * self.num_layers
        if self.full is not None:
            name = "mla" if isinstance(self.full, MLASpec) else "full"
            for layer in self.full.layers:
                kinds[layer] = name
        for kind, group in (("swa", self.swa), ("linear", self.linear)):
            for layer in group.layers if group is not None else ():
                kinds[layer] = kind if kinds[layer] == "none" else kinds[layer]
        return tuple(kinds)


def check_page_size(page_size: int, engine_blocks: bool = False) -> None:
    """The one page-size rule (pools, a peer's claimed page size, --page-size): a power of two
    for our own pools (their page sizes are chosen, so the smaller divides the larger). A pool
    of an engine's blocks (kvpool.engine: vLLM's, whose block size vLLM may raise to 160 and
    the like to fit a hybrid model's state in a page) takes any positive size; its rows pair
    by token with any other (transfer.engine_rows; runs then end where either side's block
    ends, transfer.plan)."""
    if (
        not isinstance(page_size, int)
        or isinstance(page_size, bool)
        or page_size <= 0
        or (not engine_blocks and page_size & (page_size - 1))
    ):
        raise SpecError(f"page size {page_size!r} is not a positive {'integer' if engine_blocks else 'power of two'}")
