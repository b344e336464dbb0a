"""A layout mismatch in words: both sides' models, which side is which, what differs (one line),
and the model description on the wire (bounded, a malformed one refused)."""

import dataclasses

import msgspec
import numpy as np
import pytest

from disagg.control import layout as L
from disagg.control import messages as P
from disagg.errors import ProtocolError
from kvpool import AttentionSpec, HybridPool, Layout, LinearStateSpec, ModelSpec, NSAIndexerSpec, PoolConfig, get_preset
from transfer.buffers import buffers_of


def info(
    model: ModelSpec | str,
    page_size: int | None = None,
    described: bool = True,
    tp_size: int = 1,
    layout: str = "page_major",
) -> L.LayoutInfo:
    """The LayoutInfo a worker with this pool advertises (as worker/base.py builds it)."""
    model = get_preset(model) if isinstance(model, str) else model
    pool = HybridPool(
        PoolConfig(
            model,
            page_size or model.default_page_size,
            max_tokens=2048,
            max_requests=2,
            device="cpu",
            tp_size=tp_size,
            layout=Layout(layout),
        )
    )
    return L.LayoutInfo(
        pool.page_size,
        pool.config.layout.value,
        buffers_of(pool.buffer_descriptors()),
        L.describe_model(pool.config.model, pool.config.tp_size) if described else None,
    )


def _one_line(text: str) -> str:
    assert "\n" not in text and "\r" not in text and text.isprintable(), text
    return text


def test_the_issue_gpt_oss_120b_prefill_with_gpt_oss_20b_decode():
    why = _one_line(L.layout_difference(prefill=info("gpt-oss-120b"), decode=info("gpt-oss-20b")))
    assert why.startswith("prefill gpt-oss-120b vs decode gpt-oss-20b: "), why
    assert "layers: prefill 36, decode 24" in why
    assert "full attention layers: prefill 18, decode 12" in why and "swa layers: prefill 18, decode 12" in why
    assert "None" not in why and "B/item" not in why  # words, not buffer tuples
    # the other way round names the sides the other way round
    back = L.layout_difference(prefill=info("gpt-oss-20b"), decode=info("gpt-oss-120b"))
    assert back.startswith("prefill gpt-oss-20b vs decode gpt-oss-120b: ") and "layers: prefill 24, decode 36" in back


def test_same_model_same_pool_is_no_difference():
    assert L.layout_difference(info("tiny-hybrid"), info("tiny-hybrid")) is None
    assert L.layout_difference(info("gpt-oss-20b"), info("gpt-oss-20b", described=False)) is None


def test_page_sizes_may_differ_where_both_sides_describe_the_same_model():
    """Pools of different page sizes pair by token (transfer.tokens); the description is the
    only thing that shows such pools hold the same model, so a side without one is refused."""
    for layout in ("page_major", "layer_major"):
        assert (
            L.layout_difference(
                prefill=info("tiny-hybrid", 4, layout=layout), decode=info("tiny-hybrid", 8, layout=layout)
            )
            is None
        )
        assert (
            L.layout_difference(
                prefill=info("gpt-oss-20b", 64, layout=layout), decode=info("gpt-oss-20b", 1, layout=layout)
            )
            is None
        )
    why = _one_line(L.layout_difference(prefill=info("tiny-hybrid", 4), decode=info("tiny-hybrid", 8, described=False)))
    assert why == (
        "prefill tiny-hybrid vs decode (model not described): page size: prefill 4, decode 8 (pools of "
        "different page sizes pair only where both sides describe their model)"
    )
    other = _one_line(L.layout_difference(prefill=info("gpt-oss-120b", 16), decode=info("gpt-oss-20b", 64)))
    assert "layers: prefill 36, decode 24" in other
    mixed = _one_line(
        L.layout_difference(prefill=info("tiny-hybrid", 4), decode=info("tiny-hybrid", 8, layout="layer_major"))
    )
    assert "pool layout: prefill page_major, decode layer_major" in mixed


def test_a_sliding_window_difference_is_refused_though_the_buffers_pair_up():
    """The window decides which SWA pages each side keeps and sends (the window's only), and no
    buffer shows it: with two windows the pages would pair up by position wrongly (the planner
    truncates SWA from the end it keeps), so the description refuses here, as words never do."""
    base = get_preset("gpt-oss-20b")
    wider = dataclasses.replace(base, swa=dataclasses.replace(base.swa, window=2 * base.swa.window))
    p, d = info(base), info(wider)
    assert p.buffers == d.buffers
    why = _one_line(L.layout_difference(prefill=p, decode=d))
    assert f"swa window: prefill {base.swa.window}, decode {2 * base.swa.window}" in why
    assert L.layout_difference(prefill=p, decode=info(wider, described=False)) is None  # cannot tell


def test_a_conv_state_layout_difference_is_refused_though_the_buffers_pair_up():
    """vLLM keeps a GDN conv state [width, channels] ("SD") or [channels, width] ("DS", where
    NixlConnector is configured, or VLLM_SSM_CONV_STATE_LAYOUT says so): same bytes per slot, so
    equal TP and page sizes would move whole state pages of one layout into the other's. The
    description refuses it, naming both."""
    base = get_preset("qwen3-next-80b-a3b")
    sd = dataclasses.replace(base, linear=dataclasses.replace(base.linear, conv_transposed=True))
    p, d = info(base), info(sd)
    assert p.buffers == d.buffers
    why = _one_line(L.layout_difference(prefill=p, decode=d))
    assert "linear state conv state: prefill channels x width, decode width x channels" in why
    assert L.layout_difference(prefill=info(sd), decode=info(sd)) is None
    assert L.layout_difference(prefill=p, decode=info(sd, described=False)) is None  # cannot tell


def test_dtype():
    base = get_preset("tiny-full")
    fp8 = dataclasses.replace(base, full=dataclasses.replace(base.full, dtype="float8_e4m3fn"))
    why = _one_line(L.layout_difference(prefill=info(base), decode=info(fp8)))
    assert "full attention dtype: prefill bfloat16, decode float8_e4m3fn" in why


def test_heads_and_dims():
    gpt = get_preset("gpt-oss-20b")
    wider = dataclasses.replace(gpt, name="gpt-oss-20b-12h", full=dataclasses.replace(gpt.full, kv_heads=12))
    why = L.layout_difference(prefill=info(gpt), decode=info(wider))
    assert why == (
        "prefill gpt-oss-20b vs decode gpt-oss-20b-12h: "
        "full attention kv_heads x head_dim: prefill 8 x 64, decode 12 x 64"
    )
    mimo = L.layout_difference(prefill=info("mimo-v2-flash"), decode=info("gpt-oss-20b"))
    assert "full attention kv_heads x head_dim: prefill 4 x 192/128, decode 8 x 64" in mimo  # k/v dims differ


def test_conv_groups_are_named_when_they_differ():
    """TP splits each conv group on its own: a GDN's q | k | v is not 8192 plain channels."""
    tiny = get_preset("tiny-mamba")
    plain = dataclasses.replace(tiny, linear=dataclasses.replace(tiny.linear, conv_groups=None))
    why = L.layout_difference(prefill=info(tiny, page_size=4), decode=info(plain, page_size=16))
    assert why.endswith("linear state conv groups (units x channels): prefill 4 x 2 + 2 x 2 + 2 x 2, decode 16 x 1")


def test_a_component_one_side_lacks():
    swa = get_preset("tiny-swa")
    no_swa = ModelSpec("tiny-full-only", 4, full=swa.full, default_page_size=4)
    why = _one_line(L.layout_difference(prefill=info(swa), decode=info(no_swa)))
    assert why == "prefill tiny-swa vs decode tiny-full-only: components: prefill has swa, decode has none"
    why = L.layout_difference(prefill=info("tiny-swa"), decode=info("tiny-mla-nsa"))
    assert "components: prefill has full attention + swa, decode has mla + nsa indexer" in why


def test_layer_count():
    full = get_preset("tiny-full")
    deeper = ModelSpec("tiny-full-6", 6, full=AttentionSpec(tuple(range(6)), 2, 16, 16), default_page_size=4)
    why = L.layout_difference(prefill=info(deeper), decode=info(full))
    assert why == (
        "prefill tiny-full-6 vs decode tiny-full: layers: prefill 6, decode 4; "
        "full attention layers: prefill 6, decode 4"
    )


def test_tp_size_and_pool_layout():
    # TP sizes may differ (the KV is resharded): the same model is enough here (the sender
    # checks the buffers against its model at decode's TP size when it connects)
    assert L.layout_difference(prefill=info("tiny-full", tp_size=2), decode=info("tiny-full")) is None
    full = get_preset("tiny-full")
    deeper = ModelSpec("tiny-full-6", 6, full=AttentionSpec(tuple(range(6)), 2, 16, 16), default_page_size=4)
    why = L.layout_difference(prefill=info(deeper, tp_size=2), decode=info(full))
    assert why.startswith("prefill tiny-full-6 (tp 2) vs decode tiny-full: layers: prefill 6, decode 4")
    why = L.layout_difference(prefill=info("tiny-full"), decode=info("tiny-full", layout="layer_major"))
    assert why == "prefill tiny-full vs decode tiny-full: pool layout: prefill page_major, decode layer_major"


def test_a_peer_without_a_description_gets_the_buffer_difference():
    why = _one_line(L.layout_difference(prefill=info("tiny-hybrid"), decode=info("tiny-mamba", described=False)))
    assert why.startswith(
        "prefill tiny-hybrid vs decode (model not described): buffers (prefill = source, "
        "decode = destination): component sets differ"
    )


def test_alike_descriptions_with_different_buffers_fall_back_to_the_buffers():
    """The description is words only: the check is the buffers' (a peer may lie or pad)."""
    a, b = info("tiny-full"), info("tiny-full", tp_size=2)
    why = L.layout_difference(prefill=a, decode=msgspec.structs.replace(b, model=a.model))
    assert "buffers (prefill = source, decode = destination): full buffer 0: source" in why


def test_many_differences_are_counted_not_all_listed():
    other = ModelSpec(
        "tiny-other",
        8,
        full=AttentionSpec((2, 5), 4, 16, 16, dtype="float16"),
        swa=AttentionSpec((0, 3), 2, 16, 16, dtype="float16", window=3),
        nsa=NSAIndexerSpec((2, 5), key_dim=64, scale_block=64),
        linear=LinearStateSpec((1, 4), 16, 4, 4, 8, 8),
        default_page_size=8,
    )
    why = _one_line(L.layout_difference(prefill=info("tiny-hybrid"), decode=info(other)))
    assert why.count(";") == L.MAX_WORDS and why.endswith(" more"), why
    assert why.startswith("prefill tiny-hybrid vs decode tiny-other: layers: ")  # (page sizes may differ)


def test_a_hostile_description_stays_one_bounded_line():
    a = info("tiny-full")
    name = "x" * L.MAX_NAME_CHARS
    d = L.ModelDescription(
        name, 1 << 20, 1 << 20, swa=L.AttentionDescription(1 << 20, 1 << 30, 1, 1, "A" * 32, 1 << 30)
    )
    frame = P.encoder.encode(P.RegisterDecode(P.PROTOCOL_VERSION, 1, msgspec.structs.replace(a, model=d), [], None))
    msg = P.Decoder(P.ToPrefill, "control").decode(frame)
    why = _one_line(L.layout_difference(prefill=info("tiny-swa"), decode=msg.layout))
    assert len(why) < 1000 and name in why


def test_describe_model_clips_what_it_cannot_send():
    spec = dataclasses.replace(get_preset("tiny-full"), name="a\nmodel" + "y" * 500)
    d = L.describe_model(spec)
    assert len(d.name) == L.MAX_NAME_CHARS and "\n" not in d.name
    layout = L.LayoutInfo(4, "page_major", info("tiny-full").buffers, d)
    frame = P.encoder.encode(P.RegisterDecode(P.PROTOCOL_VERSION, 1, layout, [], None))
    assert P.Decoder(P.ToPrefill, "control").decode(frame).layout == layout  # the peer can decode it


def test_an_old_peer_without_a_description_still_decodes():
    layout = info("tiny-full", described=False)
    raw = msgspec.msgpack.decode(P.encoder.encode(P.RegisterDecode(P.PROTOCOL_VERSION, 1, layout, [], None)))
    del raw["layout"]["model"]
    assert P.Decoder(P.ToPrefill, "control").decode(msgspec.msgpack.encode(raw)).layout.model is None


@pytest.mark.parametrize(
    "path,bad",
    [
        (("name",), "n" * (L.MAX_NAME_CHARS + 1)),
        (("name",), ""),
        (("name",), "two\nlines"),
        (("name",), 7),
        (("tp_size",), 0),
        (("num_layers",), -1),
        (("num_layers",), 1 << 40),
        (("full",), "attention"),
        (("full", "kv_heads"), 0),
        (("full", "k_dim"), 1 << 62),
        (("full", "dtype"), "bf16; drop"),
        (("full", "dtype"), "f" * 33),
        (("swa",), {"layers": 1}),
        (("linear",), [1, 2, 3]),
    ],
)
def test_a_malformed_description_is_refused_with_a_reason(path, bad):
    good = info("tiny-full")
    raw = msgspec.msgpack.decode(P.encoder.encode(P.RegisterDecode(P.PROTOCOL_VERSION, 1, good, [], None)))
    node = raw["layout"]["model"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(ProtocolError, match=r"undecodable frame \(.*\$\.layout\.model"):
        P.Decoder(P.ToPrefill, "control").decode(msgspec.msgpack.encode(raw))


@pytest.mark.parametrize("bad", [0, -16, 1 << 21, "16"])
def test_a_page_size_outside_bounds_is_refused_when_decoded(bad):
    """Page sizes may differ now, so a peer's is used: decoding bounds it (the sender then
    refuses anything but a power of two whose buffers are its model's)."""
    raw = msgspec.msgpack.decode(P.encoder.encode(P.RegisterDecode(P.PROTOCOL_VERSION, 1, info("tiny-full"), [], None)))
    raw["layout"]["page_size"] = bad
    with pytest.raises(ProtocolError, match=r"undecodable frame \(.*\$\.layout\.page_size"):
        P.Decoder(P.ToPrefill, "control").decode(msgspec.msgpack.encode(raw))


@pytest.mark.slow
def test_a_pair_of_different_presets_fails_requests_with_the_words():
    """Real servers in this process: decode (tiny-full) looks up a prefill (tiny-swa); the
    request fails with both presets named and the difference; a decode that registers anyway
    is refused by prefill in the same words."""
    import zmq

    from disagg.decode.server import DecodeConfig, DecodeServer
    from disagg.prefill.server import PrefillConfig, PrefillServer
    from disagg.worker.pool_settings import PoolSettings

    prefill = PrefillServer(
        PrefillConfig(
            pool=PoolSettings(preset="tiny-swa", max_tokens=2048, max_requests=4, device="cpu"),
            bootstrap_bind="tcp://127.0.0.1:*",
        )
    )
    decode = DecodeServer(
        DecodeConfig(
            pool=PoolSettings(preset="tiny-full", max_tokens=2048, max_requests=4, device="cpu"),
            bootstrap_addr=prefill.bootstrap_endpoint,
        )
    )
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        dec = decode.decode(1, np.arange(20), 1)
        assert dec["state"] == "FAILED"
        reason = _one_line(dec["reason"])
        assert (
            "prefill layout differs: prefill tiny-swa vs decode tiny-full: components: prefill has swa, "
            "decode has none; full attention layers: prefill 2, decode 4; "
            "full attention kv_heads x head_dim: prefill 2 x 8, decode 2 x 16"
        ) in reason, reason
        sock.connect(prefill.control_endpoint)
        sock.send(P.encoder.encode(P.RegisterDecode(P.PROTOCOL_VERSION, 1, decode.layout, [], None)))
        assert sock.poll(10_000)
        reply = P.Decoder(P.ToDecode, "t").decode(sock.recv())
        assert isinstance(reply, P.Refused)
        assert reply.reason.startswith(
            "layout mismatch: prefill tiny-swa vs decode tiny-full: components: prefill has swa, decode has none"
        ), reply.reason
    finally:
        sock.close()
        decode.close()
        prefill.close()


def test_another_checkpoint_of_one_geometry_is_refused_naming_the_difference():
    """Same pools, same geometry, different weights (or config): the models are not the same."""
    from disagg.control.layout import LayoutInfo, describe_model, layout_difference

    spec = get_preset("tiny-hybrid")
    a = {"config_hash": "sha256:" + "a" * 32, "weights": "sha256:" + "1" * 32}
    b = {**a, "weights": "sha256:" + "2" * 32}
    info = lambda ident: LayoutInfo(4, "page_major", [], describe_model(spec, 1, ident))  # noqa: E731
    assert layout_difference(info(a), info(a)) is None and layout_difference(info(None), info(None)) is None
    why = layout_difference(info(a), info(b))
    assert why == (
        f"prefill tiny-hybrid vs decode tiny-hybrid: weights: prefill sha256:{'1' * 32}, decode "
        f"sha256:{'2' * 32} (both sides must load the same model)"
    ), why
    assert "model config: prefill sha256:" in layout_difference(info(a), info({**b, "config_hash": "sha256:bb"}))
    assert "weights: prefill sha256:" in layout_difference(info(a), info(None))


def test_another_prefill_chunk_is_refused_naming_both():
    """Decode caches a prompt's whole chunks and checks against the colocated run in its own
    passes: a prefill that computes prompts in other passes is another computation."""
    from disagg.control.layout import LayoutInfo, describe_model, layout_difference

    spec = get_preset("tiny-hybrid")
    same = {"config_hash": "sha256:" + "a" * 32, "weights": "sha256:" + "1" * 32}
    info = lambda chunk: LayoutInfo(4, "page_major", [], describe_model(spec, 1, {**same, "prefill_chunk": chunk}))  # noqa: E731
    assert layout_difference(info(8), info(8)) is None
    assert layout_difference(info(16), info(8)) == (
        "prefill tiny-hybrid vs decode tiny-hybrid: prefill chunk (--prefill-chunk): prefill 16 tokens, "
        "decode 8 tokens (both sides must compute prompts in the same passes)"
    )
    assert "prefill 0 (one pass), decode 8 tokens" in layout_difference(info(0), info(8))
    wire = msgspec.json.decode(msgspec.json.encode(info(0)), type=LayoutInfo)  # 0 is a value on the wire
    assert wire.model.prefill_chunk == 0
