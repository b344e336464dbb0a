"""What a side's pool looks like to its peer (LayoutInfo), and the one check of whether a
transfer between two of them is meaningful.

A layout also describes the model behind it (ModelDescription: name, TP size, per component
its layer count, heads, dims, dtypes, window), so a refused registration can say in words
what differs and which side is which; the check itself compares pool layout, buffers and
the sliding window (it decides which pages each side keeps and nothing in the buffers shows
it; a side that sends no description cannot be checked for it). Page sizes may differ
(transfer.tokens moves such pools' KV by token): then the models must be described alike,
the one case where the description decides. A model engine also names its model's config
hash and weights fingerprint (engine/model/source.py): where both sides describe their model
and those differ, registration is refused at any page size (another checkpoint of one
architecture has the same pools and different outputs). Every field is bounded when
decoded: a peer's description is untrusted.
"""

from typing import Annotated

import msgspec

from kvpool.spec import AttentionSpec, MLASpec, ModelSpec
from transfer.buffers import Buffer, layout_difference as buffer_difference

# ---- the model behind a layout (words for a mismatch; every field bounded when decoded) ----
MAX_NAME_CHARS = 128
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[ -~]+$")]  # printable ASCII
DType = Annotated[str, msgspec.Meta(min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_]+$")]
Count = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]  # layers, TP size
Dim = Annotated[int, msgspec.Meta(ge=1, le=1 << 30)]  # heads, dims, windows
Tokens = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]  # a token count that may be 0 (prefill chunk)
Hash = Annotated[str, msgspec.Meta(min_length=1, max_length=80, pattern=r"^[a-z0-9]+:[0-9a-f]+$")]  # sha256:hex


class AttentionDescription(msgspec.Struct, frozen=True):
    layers: Count
    kv_heads: Dim  # the whole model's (before the TP split)
    k_dim: Dim
    v_dim: Dim
    dtype: DType
    window: Dim | None = None


class MLADescription(msgspec.Struct, frozen=True):
    layers: Count
    latent_dim: Dim
    dtype: DType


class NSADescription(msgspec.Struct, frozen=True):
    layers: Count
    key_dim: Dim
    key_dtype: DType
    scale_block: Dim
    scale_dtype: DType


class LinearDescription(msgspec.Struct, frozen=True):
    layers: Count
    conv_dim: Dim
    conv_width: Dim
    temporal_heads: Dim
    temporal_d1: Dim
    temporal_d2: Dim
    conv_dtype: DType
    temporal_dtype: DType
    # (units, channels per unit) of the conv channels (kvpool.spec.LinearStateSpec.conv_layout):
    # TP splits each group on its own, so two sides must agree on them to reshard
    conv_groups: Annotated[list[tuple[Dim, Dim]], msgspec.Meta(max_length=16)] | None = None
    conv_transposed: bool = False  # [conv_width, conv_dim] per slot (vLLM's "SD"), not [conv_dim, conv_width]


class ModelDescription(msgspec.Struct, frozen=True):
    """The model a side's pool was built for, in the terms a person compares two sides in."""

    name: Name  # the preset (or the model a model engine read its geometry off)
    tp_size: Count
    num_layers: Count
    full: AttentionDescription | None = None  # full attention (MHA/GQA) ...
    mla: MLADescription | None = None  # ... or latent attention on the full layers
    swa: AttentionDescription | None = None
    nsa: NSADescription | None = None
    linear: LinearDescription | None = None
    # which model, not only which geometry (a model engine's; engine/model/source.py): two
    # checkpoints of one architecture have the same pools and different outputs
    config_hash: Hash | None = None
    weights: Hash | None = None
    # tokens per prefill pass (a model engine's; 0: one pass): decode caches a prompt's whole
    # chunks and checks against the colocated run in its own passes, so both must agree
    prefill_chunk: Tokens | None = None


def _clip_name(name: str) -> str:
    name = "".join(ch if " " <= ch <= "~" else "?" for ch in str(name))[:MAX_NAME_CHARS]
    return name or "?"


def describe_model(model: ModelSpec, tp_size: int = 1, identity: dict | None = None) -> ModelDescription:
    """What a side tells its peer about `model` (a pool's config.model, split `tp_size` ways);
    `identity`: the engine's config_hash and weights fingerprint, where it has them."""

    def attention(a: AttentionSpec | None) -> AttentionDescription | None:
        if a is None:
            return None
        return AttentionDescription(len(a.layers), a.kv_heads, a.k_dim, a.v_dim, a.dtype, a.window)

    full = model.full
    lin, nsa = model.linear, model.nsa
    return ModelDescription(
        _clip_name(model.name),
        tp_size,
        model.num_layers,
        full=attention(full) if isinstance(full, AttentionSpec) else None,
        mla=MLADescription(len(full.layers), full.latent_dim, full.dtype) if isinstance(full, MLASpec) else None,
        swa=attention(model.swa),
        nsa=None
        if nsa is None
        else NSADescription(len(nsa.layers), nsa.key_dim, nsa.key_dtype, nsa.scale_block, nsa.scale_dtype),
        linear=None
        if lin is None
        else LinearDescription(
            len(lin.layers),
            lin.conv_dim,
            lin.conv_width,
            lin.temporal_heads,
            lin.temporal_d1,
            lin.temporal_d2,
            lin.conv_dtype,
            lin.temporal_dtype,
            [tuple(g) for g in lin.conv_layout],
            conv_transposed=lin.conv_transposed,
        ),
        **(identity or {}),
    )


class LayoutInfo(msgspec.Struct, frozen=True):
    """What must match between the two sides for a transfer to be meaningful, and the model
    behind it (None from a peer that does not describe it: the words fall back to buffers)."""

    page_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
    layout: str  # page_major | layer_major
    buffers: list[Buffer]  # the pool's buffers, region i = buffer i
    model: ModelDescription | None = None


_LABELS = {"full": "full attention", "mla": "mla", "swa": "swa", "nsa": "nsa indexer", "linear": "linear state"}
MAX_WORDS = 8  # differences named in one message; the rest are counted
MAX_BUFFER_WORDS = 300  # characters of a buffer-level difference (a peer's part names are not bounded)


def _properties(d) -> list[tuple[str, object]]:
    """One component's description as (what, value) pairs, in the order they are compared."""
    if isinstance(d, AttentionDescription):
        dims = d.k_dim if d.k_dim == d.v_dim else f"{d.k_dim}/{d.v_dim}"
        return [
            ("layers", d.layers),
            ("kv_heads x head_dim", f"{d.kv_heads} x {dims}"),
            ("dtype", d.dtype),
            ("window", d.window if d.window is not None else "none"),
        ]
    if isinstance(d, MLADescription):
        return [("layers", d.layers), ("latent_dim", d.latent_dim), ("dtype", d.dtype)]
    if isinstance(d, NSADescription):
        return [
            ("layers", d.layers),
            ("key_dim", d.key_dim),
            ("key dtype", d.key_dtype),
            ("scale_block", d.scale_block),
            ("scale dtype", d.scale_dtype),
        ]
    return [
        ("layers", d.layers),
        ("conv_dim x conv_width", f"{d.conv_dim} x {d.conv_width}"),
        ("temporal heads x d1 x d2", f"{d.temporal_heads} x {d.temporal_d1} x {d.temporal_d2}"),
        ("conv dtype", d.conv_dtype),
        ("temporal dtype", d.temporal_dtype),
        ("conv groups (units x channels)", " + ".join(f"{u} x {c}" for u, c in d.conv_groups or ()) or "not described"),
        ("conv state", "width x channels" if d.conv_transposed else "channels x width"),
    ]


def identity_differences(prefill: ModelDescription, decode: ModelDescription) -> list[str]:
    """Where the two sides hold different models of one geometry (another checkpoint, another
    config), in words; nothing where neither side describes it (geometry presets, stand-in)."""
    out = []
    for what, p, d in (
        ("model config", prefill.config_hash, decode.config_hash),
        ("weights", prefill.weights, decode.weights),
    ):
        if p != d:
            out.append(
                f"{what}: prefill {p or 'not described'}, decode {d or 'not described'} "
                f"(both sides must load the same model)"
            )
    if prefill.prefill_chunk != decode.prefill_chunk:
        out.append(
            f"prefill chunk (--prefill-chunk): prefill {_chunk(prefill.prefill_chunk)}, decode "
            f"{_chunk(decode.prefill_chunk)} (both sides must compute prompts in the same passes)"
        )
    return out


def _chunk(tokens: int | None) -> str:
    return "not described" if tokens is None else "0 (one pass)" if tokens == 0 else f"{tokens} tokens"


def model_differences(prefill: ModelDescription, decode: ModelDescription) -> list[str]:
    """Every difference between the two sides' models, in words ("what: prefill X, decode Y")."""
    out = identity_differences(prefill, decode)
    if prefill.num_layers != decode.num_layers:  # (TP sizes may differ: transfer.reshard)
        out.append(f"layers: prefill {prefill.num_layers}, decode {decode.num_layers}")
    kinds = [k for k in _LABELS if getattr(prefill, k) is not None or getattr(decode, k) is not None]
    only_p = [_LABELS[k] for k in kinds if getattr(decode, k) is None]
    only_d = [_LABELS[k] for k in kinds if getattr(prefill, k) is None]
    if only_p or only_d:
        out.append(f"components: prefill has {' + '.join(only_p) or 'none'}, decode has {' + '.join(only_d) or 'none'}")
    for k in kinds:
        p, d = getattr(prefill, k), getattr(decode, k)
        if p is None or d is None:
            continue
        for (what, pv), (_, dv) in zip(_properties(p), _properties(d)):
            if pv != dv:
                out.append(f"{_LABELS[k]} {what}: prefill {pv}, decode {dv}")
    return out


def _side(role: str, info: LayoutInfo) -> str:
    m = info.model
    if m is None:
        return f"{role} (model not described)"
    return f"{role} {m.name}" + (f" (tp {m.tp_size})" if m.tp_size != 1 else "")


def _one_line(text: str) -> str:
    return "".join(ch if ch.isprintable() else "?" for ch in text)


def layout_difference(prefill: LayoutInfo, decode: LayoutInfo) -> str | None:
    """None if a transfer between the two sides' layouts is meaningful (same pool layout and
    buffers, by transfer.buffers' one check, and the same sliding window where both sides
    describe theirs; pools of different page sizes pair by token (transfer.tokens) and TP
    shards of different sizes by slice (transfer.reshard): then both must describe the same
    model, and the prefill side checks the buffers against its model at decode's page size
    and TP size when it connects),
    else one line naming both sides' models and what differs in words, e.g.
    "prefill gpt-oss-120b vs decode gpt-oss-20b: layers: prefill 36, decode 24; ...". The
    buffers are compared with prefill as the source and decode as the destination. Where
    both describe them, the sliding window and a conv state's layout must match too (no
    buffer shows either)."""
    described = prefill.model is not None and decode.model is not None
    same_pages = prefill.page_size == decode.page_size
    same_tp = not described or prefill.model.tp_size == decode.model.tp_size
    buffers = buffer_difference(prefill.buffers, decode.buffers, paged=same_pages and same_tp, per_request=same_tp)
    windows = [
        i.model.swa.window if i.model is not None and i.model.swa is not None else None for i in (prefill, decode)
    ]
    same_window = None in windows or windows[0] == windows[1]
    # a conv state's layout ([width, channels] or [channels, width]): no buffer shows it either,
    # and whole state pages of one would land as the other's
    convs = [
        i.model.linear.conv_transposed if i.model is not None and i.model.linear else None for i in (prefill, decode)
    ]
    same_conv = None in convs or convs[0] == convs[1]
    same_model = (
        (same_pages and same_tp) or (described and not model_differences(prefill.model, decode.model))
    ) and not (described and identity_differences(prefill.model, decode.model))
    if prefill.layout == decode.layout and buffers is None and same_window and same_conv and same_model:
        return None
    words = []
    if not same_pages and not described:
        words.append(
            f"page size: prefill {prefill.page_size}, decode {decode.page_size} (pools of different page "
            "sizes pair only where both sides describe their model)"
        )
    if prefill.layout != decode.layout:
        words.append(f"pool layout: prefill {prefill.layout}, decode {decode.layout}")
    if prefill.model is not None and decode.model is not None:
        words += model_differences(prefill.model, decode.model)
    if not words:  # a peer that sent no description, or models alike but buffers not (padding, versions)
        text = buffers if len(buffers) <= MAX_BUFFER_WORDS else buffers[:MAX_BUFFER_WORDS] + "..."
        words.append(f"buffers (prefill = source, decode = destination): {text}")
    more = len(words) - MAX_WORDS
    shown = "; ".join(words[:MAX_WORDS]) + (f"; and {more} more" if more > 0 else "")
    return _one_line(f"{_side('prefill', prefill)} vs {_side('decode', decode)}: {shown}")
