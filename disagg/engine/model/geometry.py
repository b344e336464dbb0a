"""A model's pool geometry, read from the model's own cache: run a 3-token probe prompt and
look at every decoder layer's cache tensors. The pool then stores exactly what the model
keeps (heads, dims, dtypes, window, state shapes); nothing is written down twice, so the two
cannot drift apart.

    cache layer (transformers)        kind     pool component, per token or per request
    DynamicLayer                      full     FULL  k [kv_heads, k_dim], v [kv_heads, v_dim]
      ... of an MLA model             mla      FULL  latent = [kv_lora_rank | rope_dim]
    DynamicIndexedLayer               mla+nsa  FULL latent, NSA key [index_head_dim] + scale
    DynamicSlidingWindowLayer         swa      SWA   k, v (window = the layer's sliding_window)
    LinearAttentionLayer              linear   MAMBA conv [channels, kernel-1] + temporal state
    LinearAttentionAndFullAttention-  full     FULL k, v and MAMBA conv + temporal state: the layer is
      Layer (falcon_h1, zamba2)                in both components (ModelSpec: full and linear layers)
    DummyLayer (MLP / MoE layers)     none     -

Conv state: transformers keeps `kernel` columns and never reads the oldest; the pool keeps
kernel-1 (as SGLang and vLLM do) and the oldest column comes back as zeros. Its channels are
groups that TP splits each on its own (kvpool.spec.LinearStateSpec.conv_groups), read off the
layer's own mixer module (the numbers transformers built it from the config with), by the
kind of mixer, and checked against the conv state's channel count and the recurrent state's
heads:

    gated delta net (qwen3_next, qwen3_5, olmo_hybrid)   [ q: k_heads x k_dim | k: k_heads x k_dim | v: v_heads x v_dim ]
    Mamba2 (nemotron_h, bamba, granitemoehybrid, ...)    [ x: heads x head_dim | B: groups x d_state | C: groups x d_state ]
    Mamba1 (jamba)                                       channels, each its own unit (its state is [channels, d_state])

A mixer of another kind, or one whose numbers do not add up to its conv state, gets no
groups and a reason (`tp_refusal`): the pool refuses TP > 1 for it rather than split its
channels blindly (a blind split moves the wrong channels to every rank, and nothing in the
outputs shows it: each rank recomputes the units it does not hold).
"""

from dataclasses import dataclass

import torch

from disagg.errors import ConfigError
from kvpool import AttentionSpec, LinearStateSpec, MLASpec, ModelSpec, NSAIndexerSpec


@dataclass(frozen=True)
class StateShape:
    """How one linear layer's state looks inside transformers (per request, batch dim dropped)."""

    conv_kernel: int  # columns transformers keeps (the pool keeps one fewer)
    recurrent: tuple[int, ...]  # [v_heads, k_dim, v_dim] (GDN, Mamba2) or [channels, d_state] (Mamba1)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _states(name: str, layer: int, cl) -> None:
    """A linear layer must hold exactly one conv state and one recurrent state (what the pool
    stores per layer): anything else is refused in words, never half carried."""
    what = f"{name}: layer {layer} ({type(cl).__name__})"
    conv = {i for i, t in cl.conv_states.items() if t is not None}
    rec = {i for i, t in cl.recurrent_states.items() if t is not None}
    if len(cl.conv_states) > 1 or conv - {0} or rec - {0}:
        raise ConfigError(
            f"{what} keeps {len(cl.conv_states)} conv/recurrent states per layer; the pool holds "
            "one of each (the others would be lost)"
        )
    if not conv and not rec:
        raise ConfigError(
            f"{what} filled no state in the cache it was given (the model keeps its state elsewhere, "
            "as pure state-space models such as mamba and mamba2 do); not supported"
        )
    if not rec:
        raise ConfigError(
            f"{what} keeps a conv state and no recurrent state (a short-convolution layer, as "
            "lfm2's); the pool has no geometry for conv-only layers yet"
        )
    if not conv:
        raise ConfigError(f"{what} keeps a recurrent state and no conv state; the pool has no geometry for that")


def _kind(name: str, layer: int, cl, is_mla: bool) -> str:
    has_state = hasattr(cl, "conv_states")
    has_kv = getattr(cl, "keys", None) is not None
    if has_state:
        _states(name, layer, cl)
    if has_state and not has_kv:
        return "linear"
    if not has_kv:
        return "none"
    if getattr(cl, "indexer_keys", None) is not None:
        return "mla+nsa"
    if getattr(cl, "is_sliding", False):
        return "swa"
    return "mla" if is_mla else "full"


def _one(what: str, values: set):
    if len(values) != 1:
        raise ConfigError(f"{what} differ between layers ({sorted(values)}): one pool component needs one geometry")
    return values.pop()


@dataclass(frozen=True)
class ConvGroups:
    """How TP may split one linear layer's conv channels: `groups` ((units, channels per unit)
    in channel order; None: every channel its own unit), or `refusal` (why it may not)."""

    groups: tuple[tuple[int, int], ...] | None = None
    refusal: str = ""


def _mixer(layer, channels: int):
    """The module of a decoder layer that owns the conv of `channels` channels (None if none)."""
    for module in layer.modules():
        for conv in (getattr(module, "conv1d", None), getattr(module, "conv", None)):
            if isinstance(conv, torch.nn.Conv1d) and conv.out_channels == channels:
                return module
    return None


def _has(module, *names: str) -> bool:
    return all(isinstance(getattr(module, n, None), int) for n in names)


def conv_groups(layer, index: int, channels: int, recurrent: tuple[int, ...]) -> ConvGroups:
    """The conv channel groups of decoder layer `index` (a module), whose cache holds a conv
    state of `channels` channels and a recurrent state of shape `recurrent` (batch dropped)."""
    m = _mixer(layer, channels)
    what = f"layer {index} ({type(m).__name__ if m is not None else type(layer).__name__})"
    heads = recurrent[0] if recurrent else None
    if m is None:
        return ConvGroups(refusal=f"{what}: no Conv1d of {channels} channels found, so its channel groups are unknown")
    if _has(m, "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"):  # gated delta net
        qk = (m.num_k_heads, m.head_k_dim)
        groups, state_units = (qk, qk, (m.num_v_heads, m.head_v_dim)), m.num_v_heads
    elif _has(m, "num_heads", "head_dim", "n_groups", "ssm_state_size"):  # Mamba2
        bc = (m.n_groups, m.ssm_state_size)
        groups, state_units = ((m.num_heads, m.head_dim), bc, bc), m.num_heads
    elif _has(m, "intermediate_size", "ssm_state_size") and not hasattr(m, "num_heads"):  # Mamba1
        if channels == m.intermediate_size and recurrent == (channels, m.ssm_state_size):
            return ConvGroups()
        return ConvGroups(
            refusal=f"{what}: Mamba1 conv of {channels} channels and state {recurrent} do not match "
            f"its {m.intermediate_size} channels x d_state {m.ssm_state_size}"
        )
    else:
        return ConvGroups(
            refusal=f"{what}: a mixer kind whose conv channel groups disagg cannot derive "
            "(known: gated delta net, Mamba2, Mamba1)"
        )
    held = sum(u * ch for u, ch in groups)
    if held != channels or heads != state_units:
        return ConvGroups(
            refusal=f"{what}: groups {groups} hold {held} channels and {state_units} state heads; "
            f"its conv state has {channels} channels and its recurrent state {heads} heads"
        )
    return ConvGroups(groups)


def spec_from_cache(
    name: str, cache, is_mla: bool, page_size: int, decoder=None
) -> tuple[ModelSpec, dict[int, StateShape]]:
    """The ModelSpec of the model whose probe filled `cache` (`decoder`: its decoder layer
    modules, where the conv channel groups are read; None: no groups, TP refused), and its
    linear layers' shapes."""
    kinds = [_kind(name, i, cl, is_mla) for i, cl in enumerate(cache.layers)]
    layers = lambda *ks: tuple(i for i, k in enumerate(kinds) if k in ks)  # noqa: E731
    by = lambda ks, f: {f(cache.layers[i]) for i in layers(*ks)}  # noqa: E731
    full = swa = nsa = linear = None
    if layers("full"):
        full = AttentionSpec(
            layers("full"),
            _one("full K/V heads", by(["full"], lambda c: c.keys.shape[1])),
            _one("full K dims", by(["full"], lambda c: c.keys.shape[-1])),
            _one("full V dims", by(["full"], lambda c: c.values.shape[-1])),
            dtype=_one("full dtypes", by(["full"], lambda c: _dtype(c.keys))),
        )
    if layers("mla", "mla+nsa"):
        ks = ["mla", "mla+nsa"]
        full = MLASpec(
            layers(*ks),
            _one("MLA latent dims", by(ks, lambda c: c.keys.shape[-1] + c.values.shape[-1])),
            dtype=_one("MLA dtypes", by(ks, lambda c: _dtype(c.keys))),
        )
    if layers("mla+nsa"):
        key_dim = _one("indexer key dims", by(["mla+nsa"], lambda c: c.indexer_keys.shape[-1]))
        # unquantized keys: one (unused, 1.0) scale per token keeps the pool's NSA layout
        nsa = NSAIndexerSpec(
            layers("mla+nsa"),
            key_dim=key_dim,
            scale_block=key_dim,
            scale_dtype="float32",
            key_dtype=_one("indexer dtypes", by(["mla+nsa"], lambda c: _dtype(c.indexer_keys))),
        )
    if layers("swa"):
        swa = AttentionSpec(
            layers("swa"),
            _one("SWA K/V heads", by(["swa"], lambda c: c.keys.shape[1])),
            _one("SWA K dims", by(["swa"], lambda c: c.keys.shape[-1])),
            _one("SWA V dims", by(["swa"], lambda c: c.values.shape[-1])),
            dtype=_one("SWA dtypes", by(["swa"], lambda c: _dtype(c.keys))),
            window=_one("sliding windows", by(["swa"], lambda c: c.sliding_window)),
        )
    states, layouts = {}, set()
    stateful = tuple(i for i, cl in enumerate(cache.layers) if hasattr(cl, "conv_states"))
    if stateful:
        for i in stateful:
            cl = cache.layers[i]
            states[i] = StateShape(cl.conv_states[0].shape[-1], tuple(cl.recurrent_states[0].shape[1:]))
            layouts.add(
                ConvGroups(refusal="no decoder modules to read conv groups off")
                if decoder is None
                else conv_groups(decoder[i], i, cl.conv_states[0].shape[1], states[i].recurrent)
            )
        shape = _one("recurrent state shapes", {s.recurrent for s in states.values()})
        heads, d1, d2 = (*shape, 1) if len(shape) == 2 else shape
        groups = {g.groups for g in layouts}
        refusals = sorted({g.refusal for g in layouts if g.refusal})
        if len(groups) > 1:
            refusals.append(f"conv channel groups differ between layers ({sorted(map(str, groups))})")
        of = lambda f: {f(cache.layers[i]) for i in stateful}  # noqa: E731
        linear = LinearStateSpec(
            stateful,
            _one("conv channels", of(lambda c: c.conv_states[0].shape[1])),
            _one("conv kernels", {s.conv_kernel for s in states.values()}) - 1,
            heads,
            d1,
            d2,
            conv_dtype=_one("conv dtypes", of(lambda c: _dtype(c.conv_states[0]))),
            temporal_dtype=_one("state dtypes", of(lambda c: _dtype(c.recurrent_states[0]))),
            conv_groups=None if refusals else groups.pop(),
            tp_refusal="; ".join(refusals),
        )
    if full is None and swa is None:
        raise ConfigError(
            f"{name}: no layer keeps attention K/V (a pure state-space model): the pool indexes "
            "every request by its attention pages; not supported"
        )
    spec = ModelSpec(
        name,
        len(kinds),
        full=full,
        swa=swa,
        nsa=nsa,
        linear=linear,
        default_page_size=page_size,
        notes="derived from the model's own cache",
    )
    return spec, states
