"""vLLM's Mamba/GDN state tensors in kvpool's terms (kvpool.spec.LinearStateSpec), so the
slices of a state that TP ranks hold reshard as our own pools' states do (kvpool.shards parts,
transfer.reshard), not by a mechanism of their own.

    vLLM, per rank (a state slot is one page)          LinearStateSpec (whole model)
    gated-delta-net conv state                         conv_groups: q (k_heads x k_dim), k (the
      [width, conv_dim / TP]  ("SD", vLLM's default)     same), v (v_heads x v_dim), each split
      [conv_dim / TP, width]  ("DS")                     by TP; conv_width; conv_transposed (SD)
    gated-delta-net SSM state                          temporal heads (v_heads, split by TP) x
      [v_heads / TP, v_dim, k_dim]                       v_dim x k_dim
    one page: the conv state's bytes, then the SSM state's, then padding up to the page

So a rank's share of a state page is not one byte range: in SD each of the width's columns
holds its q, k and v channels, and the SSM state its value heads. Any other state (Mamba1,
Mamba2, short conv, ...) is not described here: its pages move whole only (equal block size
and TP on both sides), and registration says so naming the layer.
"""

from dataclasses import dataclass

from kvpool.spec import LinearStateSpec


@dataclass(frozen=True)
class GDNHeads:
    """A gated-delta-net layer's heads, the whole model's (the checkpoint's linear_* fields)."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int


def gdn_state(
    layers: tuple[int, ...],
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[str, ...],
    heads: GDNHeads,
    tp_size: int,
    *,
    dim_first: bool,
) -> LinearStateSpec:
    """The LinearStateSpec of `layers` whose per-rank state vLLM keeps as `shapes` (conv, SSM)
    of `dtypes` at TP size `tp_size` (`dim_first`: the "DS" conv layout). ValueError naming
    what does not match the gated-delta-net geometry `heads`."""
    h = heads
    conv_dim = 2 * h.k_heads * h.k_dim + h.v_heads * h.v_dim
    if len(shapes) != 2 or len(dtypes) != 2 or len(shapes[0]) != 2 or conv_dim % tp_size or h.v_heads % tp_size:
        raise ValueError(f"state shapes {shapes} are not a gated-delta-net's (conv, SSM) at TP {tp_size}")
    conv = shapes[0] if dim_first else shapes[0][::-1]  # (channels, width)
    ssm = (h.v_heads // tp_size, h.v_dim, h.k_dim)
    if conv[0] != conv_dim // tp_size or tuple(shapes[1]) != ssm:
        raise ValueError(
            f"state shapes {shapes}: a gated-delta-net of {h.k_heads} key and {h.v_heads} value heads "
            f"({h.k_dim}, {h.v_dim}) holds conv channels {conv_dim // tp_size} and SSM state {ssm} on a "
            f"rank of TP {tp_size}"
        )
    return LinearStateSpec(
        layers,
        conv_dim,
        conv[1],
        h.v_heads,
        h.v_dim,
        h.k_dim,
        dtypes[0],
        dtypes[1],
        conv_groups=((h.k_heads, h.k_dim), (h.k_heads, h.k_dim), (h.v_heads, h.v_dim)),
        conv_transposed=not dim_first,
    )
