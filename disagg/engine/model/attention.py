"""Query-chunked eager attention: the families' own eager attention, run on blocks of queries.

transformers' eager attention builds the whole [heads, queries, keys] score matrix: for a
32k-token prompt of gpt-oss-120b that is 64 x 32k x 32k x 2 B = 128 GiB, and gpt-oss has no
SDPA path (its attention sinks). Rows of attention are independent, so this runs the family's
own `eager_attention_forward` on blocks of `chunk` queries against all keys, each with its rows
of the same mask: the same math, at most chunk/queries of the memory. A prompt of at most
`chunk` tokens (every decode step) is one call, exactly eager.

    scores  [h, q, k]:   | rows 0..c-1   |  -> eager(q[0:c],  k, v, mask[0:c])
                         | rows c..2c-1  |  -> eager(q[c:2c], k, v, mask[c:2c])
                         | ...           |     outputs [b, c, h, d] concatenated on dim 1
"""

import functools
import sys

import torch

NAME = "disagg_chunked_eager"
CHUNK = 1024  # queries per block: 64 heads x 1024 x 32k keys x 2 B = 4 GiB of scores at 32k


def chunked_eager(module, query, key, value, attention_mask, *, chunk: int = CHUNK, indices=None, **model_kwargs):
    """transformers' attention-function signature. `model_kwargs` (scaling, dropout, sinks,
    sliding window, ...) differ per family and go to the family's own eager function as they
    came: this adapter reads none of them."""
    if indices is not None:  # sparse attention a model applies only under "eager"
        raise RuntimeError(
            f"{type(module).__name__} passes sparse indices: its family must run plain eager "
            "attention (Family.chunked_attention=False)"
        )
    eager = sys.modules[type(module).__module__].eager_attention_forward
    n = query.shape[-2]
    if n <= chunk:
        return eager(module, query, key, value, attention_mask, **model_kwargs)
    outs = []
    for q0 in range(0, n, chunk):
        mask = attention_mask[..., q0 : q0 + chunk, :] if attention_mask is not None else None
        out, _ = eager(module, query[..., q0 : q0 + chunk, :], key, value, mask, **model_kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


def register(chunk: int = CHUNK) -> str:
    """Make `attn_implementation=<returned name>` mean this, with eager's mask (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    name = NAME if chunk == CHUNK else f"{NAME}_{chunk}"
    AttentionInterface.register(name, functools.partial(chunked_eager, chunk=chunk))
    AttentionMaskInterface.register(name, eager_mask)
    return name
