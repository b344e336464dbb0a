"""vLLM's per-layer KV tensors described as an EnginePool: one layer-major buffer per layer (K
and V buffers for a K/V-first layout), an item per block, same memory; layouts whose blocks
are not back to back are refused by name."""

import pytest
import torch

from disagg.vllm.layout import VllmLayoutError, engine_pool
from kvpool.geometry import Component
from kvpool.spec import LinearStateSpec
from transfer.buffers import buffers_of, layout_difference


def _cpu_caches(num_blocks=8, heads=2, block=16, head=64, dtype=torch.float32, layers=(1, 0)):
    """vLLM's CPU layout: [num_blocks, num_kv_heads, block_size, 2 * head_size] per layer."""
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(num_blocks, heads, block, 2 * head, dtype=dtype) for i in layers
    }


def _bufs(caches, block=16):
    return buffers_of(engine_pool(caches, block, "tiny").buffer_descriptors())


def test_cpu_layout_is_one_buffer_per_layer_with_a_block_per_item():
    caches = _cpu_caches()
    pool = engine_pool(caches, 16, "tiny")
    assert [(b.region, b.item_bytes, b.num_items, b.component, b.layer, b.part) for b in _bufs(caches)] == [
        (i, 2 * 16 * 128 * 4, 8, Component.FULL, i, "kv") for i in range(2)
    ]
    full = pool.config.model.full
    assert (full.layers, full.kv_heads, full.k_dim, full.dtype) == ((0, 1), 2, 64, "float32")
    src = caches["model.layers.0.self_attn.attn"]
    pool.exposed_tensors()[Component.FULL][0][3].fill_(7)  # the view is vLLM's memory
    assert (src[3].view(torch.uint8) == 7).all() and not (src[2].view(torch.uint8) == 7).all()


def test_kv_first_layout_is_k_and_v_buffers():
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, 8, 16, 2, 64) for i in range(2)}
    assert [(b.layer, b.part, b.item_bytes) for b in _bufs(caches)] == [
        (i, p, 16 * 2 * 64 * 4) for i in range(2) for p in ("k", "v")
    ]


def test_two_sides_of_one_model_pair_and_another_block_size_does_not():
    a, b = _bufs(_cpu_caches()), _bufs(_cpu_caches(num_blocks=20))
    assert layout_difference(a, b) is None  # capacity may differ
    c = _bufs(_cpu_caches(block=32), block=32)
    assert "B/item" in layout_difference(a, c)
    with pytest.raises(VllmLayoutError, match="blocks of 32 tokens, vLLM's block size is 16"):
        engine_pool(_cpu_caches(block=32), 16, "tiny")


def test_block_outermost_layout_is_refused_by_name():
    whole = torch.zeros(8, 2, 2, 16, 128)  # [blocks, layers, heads, tokens, 2 x head]: BLHNC
    caches = {f"model.layers.{i}.self_attn.attn": whole[:, i] for i in range(2)}
    with pytest.raises(VllmLayoutError, match="BLHNC"):
        engine_pool(caches, 16, "tiny")


def test_a_hybrid_page_pool_is_one_buffer_of_whole_pages():
    """Qwen3-Next on vLLM's CPU workers (seen in a real server's register_kv_caches): a GDN
    layer's state as an int8 [blocks, 1, 1, state bytes] view, block stride the page, and an
    attention layer's blocks over the same pages."""
    page = 2 * 16 * 128 * 4
    raw = torch.zeros(8 * page, dtype=torch.uint8)
    caches = {
        "model.layers.0.linear_attn": torch.as_strided(raw.view(torch.int8), (8, 1, 1, 3000), (page, 3000, 3000, 1)),
        "model.layers.1.self_attn.attn": raw.view(torch.float32).view(8, 2, 16, 128),
    }
    why = "state layer 'model.layers.0.linear_attn': a MAMBA2 state is not described as TP slices"
    pool = engine_pool(caches, 16, "tiny", state_layers=frozenset({"model.layers.0.linear_attn"}), state_refusal=why)
    assert [(b.layer, b.part, tuple(b.blocks.shape)) for b in pool.buffers] == [
        (1, "kv", (8, page))
    ]  # attention's rows
    assert pool.config.model.full.layers == (1,) and pool.config.model.num_layers == 2
    assert pool.no_rows.endswith(why) and pool.config.model.linear is None  # whole pages only, the layer named
    state = LinearStateSpec((0,), 24, 3, 1, 8, 8, "float32", "float32", conv_groups=((1, 8), (1, 8), (1, 8)))
    pool = engine_pool(caches, 16, "tiny", state_layers=frozenset({"model.layers.0.linear_attn"}), state=state)
    assert (pool.no_rows, pool.config.model.linear) == ("", state) and "equal block sizes" in pool.whole_states


def test_a_name_without_a_layer_index_or_a_state_layer_not_named_is_refused():
    with pytest.raises(VllmLayoutError, match="no '.layers.N.'"):
        engine_pool({"attn": torch.zeros(4, 1, 16, 128)}, 16, "tiny")
    with pytest.raises(VllmLayoutError, match="Mamba/GDN"):
        engine_pool({"model.layers.0.linear_attn": [torch.zeros(4, 8), torch.zeros(4, 8, 8)]}, 16, "tiny")


def test_a_block_size_that_is_not_a_power_of_two_is_described():
    """vLLM raises a hybrid model's block size to fit its state in a page (160 for the tiny
    Qwen3-Next): an engine pool pairs whole blocks of equal size only, so 160 is a pool's
    block size like any other (kvpool.spec.check_page_size, engine_blocks)."""
    pool = engine_pool(_cpu_caches(block=160), 160, "tiny")
    assert pool.config.shard.page_size == 160 and pool.config.shard.engine_blocks


def _written_by_vllm(block: int, dtype: torch.dtype, key: torch.Tensor, value: torch.Tensor) -> dict:
    """One layer's CPU cache (blocks of `block`) after vLLM's own kernel wrote `key`/`value`
    (one row a token) from block 1 on, with the ISA vLLM picks for the block size on a CPU
    without AMX: "vec" for blocks of a multiple of 32 tokens, else "vec16". (On an AMX CPU vLLM
    picks "amx" for bf16 in blocks of 32k; that kernel's blocks pair whole only: the test below.)"""
    import vllm._custom_ops as ops

    tokens, heads, head = key.shape
    caches = _cpu_caches(
        num_blocks=-(-tokens // block) + 2, heads=heads, block=block, head=head, dtype=dtype, layers=(0,)
    )
    t = caches["model.layers.0.self_attn.attn"].zero_()
    k_cache, v_cache = t.view(t.shape[0], heads, 2 * block, head).chunk(2, dim=2)
    isa = "vec" if block % 32 == 0 else "vec16"
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.arange(block, block + tokens), isa)
    return caches


@pytest.mark.parametrize("src,dst,dtype", [(32, 64, torch.float32), (64, 32, torch.float32), (16, 32, torch.bfloat16)])
def test_copying_token_rows_lane_by_lane_gives_what_vllms_kernel_writes_at_the_other_block_size(src, dst, dtype):
    """vLLM's CPU attention kernel lays a block out its own way (per head: K dim-major, then V a
    row a token; ISAs "vec" and "vec16" alike). Each token's rows copied lane by lane
    (transfer.engine_rows: what sides of different block sizes pair) from a cache of `src`
    blocks into one of `dst` blocks give exactly what the kernel writes into that one itself."""
    from transfer.engine_rows import engine_lanes

    tokens = 2 * max(src, dst) + 5  # a last block part full
    bits = torch.arange(tokens * 2 * 64, dtype=torch.int32).view(tokens, 2, 64)
    key, value = (bits + 0x3C00).to(dtype), (-bits - 1).to(dtype)  # every value distinct in either dtype
    a, want = _written_by_vllm(src, dtype, key, value), _written_by_vllm(dst, dtype, key, value)
    b = {n: torch.zeros_like(t) for n, t in want.items()}
    sides = [
        (c, n, engine_lanes(engine_pool(c, n, "tiny").config.model, n, 1, _bufs(c, n), "test"))
        for c, n in ((a, src), (b, dst))
    ]
    (ca, na, la), (cb, nb, lb) = sides
    rows = torch.arange(tokens).numpy()
    ra, rb = next(iter(ca.values())).view(torch.uint8).view(-1), next(iter(cb.values())).view(torch.uint8).view(-1)
    assert len(la[Component.FULL]) == len(lb[Component.FULL])
    for x, y in zip(la[Component.FULL], lb[Component.FULL]):
        assert x.token_bytes == y.token_bytes
        for o, p in zip(x.at(rows + na).tolist(), y.at(rows + nb).tolist()):
            rb[p : p + y.token_bytes] = ra[o : o + x.token_bytes]
    differ = (next(iter(b.values())) != next(iter(want.values()))).sum().item()
    assert differ == 0, f"{differ} of {tokens * 2 * 2 * 64} K/V elements are not where vLLM's kernel puts them"


def test_a_cpu_kernel_not_described_pairs_whole_blocks_with_its_own_kind_only():
    """vLLM's CPU kernels lay a block out per ISA; by-token rows are described for vec and
    vec16 only. Another kernel's blocks carry its name in their part, so two sides pair whole
    blocks only when their kernels match, and a pool refuses by-token pairing saying why."""
    amx = engine_pool(_cpu_caches(), 16, "tiny", cpu_kernel="amx")
    vec = engine_pool(_cpu_caches(), 16, "tiny", cpu_kernel="vec")
    assert {b.part for b in buffers_of(amx.buffer_descriptors())} == {"kv@amx"}
    assert "'amx'" in amx.no_rows and "vec, vec16" in amx.no_rows and "same --block-size and TP" in amx.no_rows
    assert vec.no_rows == "" and {b.part for b in buffers_of(vec.buffer_descriptors())} == {"kv"}
    other = buffers_of(engine_pool(_cpu_caches(), 16, "tiny", cpu_kernel="neon").buffer_descriptors())
    assert layout_difference(buffers_of(amx.buffer_descriptors()), buffers_of(vec.buffer_descriptors()))
    assert layout_difference(buffers_of(amx.buffer_descriptors()), other)
    again = engine_pool(_cpu_caches(num_blocks=12), 16, "tiny", cpu_kernel="amx")
    assert layout_difference(buffers_of(amx.buffer_descriptors()), buffers_of(again.buffer_descriptors())) is None


def test_the_connector_names_the_cpu_kernel_vllm_picks(vllm_utils, tiny_llama):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from disagg.vllm.connector import cpu_kernel, kv_groups

    for block, dtype in ((32, "float32"), (16, "float32"), (32, "bfloat16")):
        cfg = vllm_utils.create_vllm_config(model=str(tiny_llama), block_size=block, dtype=dtype)
        model = cfg.model_config
        want = _get_attn_isa(model.dtype, block, model.get_head_size(), cfg.cache_config.cache_dtype)
        assert cpu_kernel(cfg) == want and kv_groups(None, block, cfg).cpu_kernel == want
    assert cpu_kernel(None) == "" and kv_groups(None, 16).cpu_kernel == ""
