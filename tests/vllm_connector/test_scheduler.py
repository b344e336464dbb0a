"""DisaggConnector's scheduler side through vLLM's real scheduler (vLLM's own test helpers, no
model run): the producer holds a finished prompt's blocks until its workers report them sent;
the consumer loads only the tokens beyond its own prefix-cache hit, waits for them, then runs;
aborts on either side; a failed load."""

import pytest

from disagg.vllm.connector import DisaggConnectorMetadata
from disagg.vllm.params import RemotePrefill

BS = 16
BOOT = "tcp://127.0.0.1:8998"


def _scheduler(u, model, role):
    cfg = u.create_vllm_config(
        model=str(model),
        block_size=BS,
        kv_connector="DisaggConnector",
        kv_connector_module_path="disagg.vllm.connector",
        kv_role=role,
        kv_connector_extra_config={"bootstrap": BOOT},
        dtype="float32",
    )
    return u.create_scheduler(cfg, num_blocks=64)


def _meta(out) -> DisaggConnectorMetadata:
    assert isinstance(out.kv_connector_metadata, DisaggConnectorMetadata)
    return out.kv_connector_metadata.step


def _free_blocks(s) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def test_producer_holds_blocks_until_sent(vllm_utils, tiny_llama):
    u = vllm_utils
    s = _scheduler(u, tiny_llama, "kv_producer")
    free0 = _free_blocks(s)
    req = u.create_request(num_tokens=40, do_remote_decode=True, block_size=BS)
    s.add_request(req)
    out = s.schedule()
    eco = s.update_from_output(out, u.create_model_runner_output([req]))
    params = eco[0].outputs[0].kv_transfer_params
    remote = RemotePrefill(**params["disagg"])
    assert params["do_remote_prefill"] is True and remote.bootstrap == BOOT and remote.num_tokens == 40
    assert _free_blocks(s) == free0 - 3  # held: 40 tokens in 3 blocks of 16
    step = _meta(s.schedule())
    [send] = step.sends
    assert (send.req_id, send.room, send.num_tokens, len(send.block_ids[0])) == (req.request_id, remote.room, 40, 3)
    s.update_from_output(s.schedule(), u.create_model_runner_output([], finished_sending={req.request_id}))
    assert _free_blocks(s) == free0
    u.assert_scheduler_empty(s)


def test_producer_abort_holds_nothing(vllm_utils, tiny_llama):
    from vllm.v1.request import RequestStatus

    u = vllm_utils
    s = _scheduler(u, tiny_llama, "kv_producer")
    req = u.create_request(num_tokens=40, do_remote_decode=True, block_size=BS)
    s.add_request(req)
    s.schedule()
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert _meta(s.schedule()).sends == []
    u.assert_scheduler_empty(s)


def _remote_request(u, num_tokens, common_prefix_len=0, room=7):
    req = u.create_request(num_tokens=num_tokens, common_prefix_len=common_prefix_len, block_size=BS)
    req.kv_transfer_params = RemotePrefill(room, BOOT, num_tokens).to_params()
    return req


def test_consumer_waits_for_remote_kv_then_runs(vllm_utils, tiny_llama):
    u = vllm_utils
    s = _scheduler(u, tiny_llama, "kv_consumer")
    req = _remote_request(u, 40)
    s.add_request(req)
    step = _meta(s.schedule())
    [load] = step.loads
    assert (load.first_token, load.num_tokens, len(load.block_ids[0])) == (0, 40, 3)
    assert load.remote.room == 7
    assert not s.running  # waiting for the KV
    s.update_from_output(s.schedule(), u.create_model_runner_output([], finished_recving={req.request_id}))
    out = s.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == [req.request_id]
    assert out.num_scheduled_tokens[req.request_id] == 1  # only the last prompt token is recomputed
    s.update_from_output(out, u.create_model_runner_output([req], use_eos=True))
    s.schedule()
    u.assert_scheduler_empty(s)


def test_kv_both_holds_one_request_and_loads_another_as_their_params_say(vllm_utils, tiny_llama):
    """One kv_both scheduler: a request asked with do_remote_decode is prefilled and its blocks
    held for a consumer (a Send); one that brings a producer's params loads them (a Load);
    a plain one is computed here and neither held nor loaded."""
    u = vllm_utils
    s = _scheduler(u, tiny_llama, "kv_both")
    free0 = _free_blocks(s)
    produced = u.create_request(num_tokens=40, do_remote_decode=True, block_size=BS)
    consumed = _remote_request(u, 40, room=11)
    plain = u.create_request(num_tokens=20, block_size=BS)
    for r in (produced, consumed, plain):
        s.add_request(r)
    out = s.schedule()
    assert [load.remote.room for load in _meta(out).loads] == [11] and not _meta(out).sends
    eco = s.update_from_output(out, u.create_model_runner_output([produced, plain], use_eos=True))
    params = {o.request_id: o.kv_transfer_params for o in eco[0].outputs}
    assert params[plain.request_id] is None and params[produced.request_id]["do_remote_prefill"] is True
    [send] = _meta(s.schedule()).sends
    assert (send.req_id, len(send.block_ids[0])) == (produced.request_id, 3)
    done = u.create_model_runner_output(
        [], finished_sending={produced.request_id}, finished_recving={consumed.request_id}
    )
    s.update_from_output(s.schedule(), done)
    out = s.schedule()
    assert out.num_scheduled_tokens == {consumed.request_id: 1}  # loaded: only its last token is computed
    s.update_from_output(out, u.create_model_runner_output([consumed], use_eos=True))
    s.schedule()
    assert _free_blocks(s) == free0
    u.assert_scheduler_empty(s)


def test_consumer_loads_only_beyond_its_prefix_cache_hit(vllm_utils, tiny_llama):
    u = vllm_utils
    s = _scheduler(u, tiny_llama, "kv_consumer")
    warm = u.create_request(num_tokens=40, common_prefix_len=32, block_size=BS)  # computed here
    s.add_request(warm)
    out = s.schedule()
    s.update_from_output(out, u.create_model_runner_output([warm], use_eos=True))
    req = _remote_request(u, 48, common_prefix_len=32)
    s.add_request(req)
    [load] = _meta(s.schedule()).loads
    assert (load.first_token, load.num_tokens, len(load.block_ids[0])) == (32, 16, 1)  # 2 blocks cached locally
    s.update_from_output(s.schedule(), u.create_model_runner_output([], finished_recving={req.request_id}))
    out = s.schedule()
    s.update_from_output(out, u.create_model_runner_output([req], use_eos=True))
    s.schedule()
    u.assert_scheduler_empty(s)


def test_consumer_abort_releases_room_and_keeps_blocks_until_load_ends(vllm_utils, tiny_llama):
    from vllm.v1.request import RequestStatus

    u = vllm_utils
    s = _scheduler(u, tiny_llama, "kv_consumer")
    free0 = _free_blocks(s)
    req = _remote_request(u, 40)
    s.add_request(req)
    s.schedule()
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    assert _free_blocks(s) == free0 - 3  # a write may still land: vLLM holds them
    [rel] = _meta(s.schedule()).releases
    assert (rel.remote.room, rel.req_id) == (7, req.request_id)
    s.update_from_output(s.schedule(), u.create_model_runner_output([], finished_recving={req.request_id}))
    s.schedule()
    assert _free_blocks(s) == free0
    u.assert_scheduler_empty(s)


def test_consumer_abort_before_scheduling_releases_room(vllm_utils, tiny_llama):
    from vllm.v1.request import RequestStatus

    u = vllm_utils
    s = _scheduler(u, tiny_llama, "kv_consumer")
    req = _remote_request(u, 40, room=9)
    s.add_request(req)
    s.finish_requests(req.request_id, RequestStatus.FINISHED_ABORTED)
    step = _meta(s.schedule())
    assert [(r.remote.room, r.req_id) for r in step.releases] == [(9, None)] and step.loads == []
    u.assert_scheduler_empty(s)


def test_failed_load_is_recomputed(vllm_utils, tiny_llama):
    u = vllm_utils
    cfg = u.create_vllm_config(
        model=str(tiny_llama),
        block_size=BS,
        kv_connector="DisaggConnector",
        kv_connector_module_path="disagg.vllm.connector",
        kv_role="kv_consumer",
        kv_connector_extra_config={"bootstrap": BOOT},
        dtype="float32",
        kv_load_failure_policy="recompute",
    )
    s = u.create_scheduler(cfg, num_blocks=64)
    req = _remote_request(u, 40)
    s.add_request(req)
    [load] = _meta(s.schedule()).loads
    bad = set(load.block_ids[0])
    s.update_from_output(
        s.schedule(), u.create_model_runner_output([], finished_recving={req.request_id}, invalid_block_ids=bad)
    )
    out = s.schedule()
    assert out.num_scheduled_tokens[req.request_id] == 40  # every prompt token computed here
    s.update_from_output(out, u.create_model_runner_output([req], use_eos=True))
    s.schedule()
    u.assert_scheduler_empty(s)


@pytest.mark.parametrize(
    "disagg",
    [
        {"room": 0, "bootstrap": BOOT, "num_tokens": 4},
        {"room": 1, "bootstrap": "http://x", "num_tokens": 4},
        {"room": 1, "bootstrap": BOOT, "num_tokens": 4, "extra": 1},
        "nope",
    ],
)
def test_malformed_params_compute_locally(vllm_utils, tiny_llama, disagg):
    u = vllm_utils
    s = _scheduler(u, tiny_llama, "kv_consumer")
    req = u.create_request(num_tokens=40, block_size=BS)
    req.kv_transfer_params = {"do_remote_prefill": True, "disagg": disagg}
    s.add_request(req)
    out = s.schedule()
    assert _meta(out).loads == [] and out.num_scheduled_tokens[req.request_id] == 40


def _hybrid_scheduler(u, model, role, policy="fail"):
    """vLLM's scheduler over three KV cache groups as HMA makes them for a hybrid model: full
    attention, a sliding window of 32 tokens, a Mamba state (its slot the last of its blocks)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    page = BS * 2 * 2 * 4
    groups = [
        KVCacheGroupSpec(
            ["model.layers.0.self_attn.attn"],
            FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=2, dtype=torch.float32),
        ),
        KVCacheGroupSpec(
            ["model.layers.1.self_attn.attn"],
            SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=2, dtype=torch.float32, sliding_window=32),
        ),
        KVCacheGroupSpec(
            ["model.layers.2.linear_attn"],
            MambaSpec(block_size=BS, shapes=((4,),), dtypes=(torch.float32,), page_size_padded=page),
        ),
    ]
    cfg = u.create_vllm_config(
        model=str(model),
        block_size=BS,
        kv_connector="DisaggConnector",
        kv_connector_module_path="disagg.vllm.connector",
        kv_role=role,
        kv_connector_extra_config={"bootstrap": BOOT},
        dtype="float32",
        kv_load_failure_policy=policy,
    )
    return u.create_scheduler(
        cfg, kv_cache_config=KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    )


def test_hybrid_producer_computes_one_token_less_and_holds_every_groups_blocks(vllm_utils, tiny_llama):
    """A state group: the prompt is prefilled without its last token (the consumer computes it
    from the state); the full group holds every block, the window group its list with vLLM's
    null block where tokens left the window, the state group its slot."""
    u = vllm_utils
    s = _hybrid_scheduler(u, tiny_llama, "kv_producer")
    req = u.create_request(num_tokens=60, do_remote_decode=True, block_size=BS)
    s.add_request(req)
    out = s.schedule()
    assert out.num_scheduled_tokens[req.request_id] == 59
    params = s.update_from_output(out, u.create_model_runner_output([req]))[0].outputs[0].kv_transfer_params
    assert params["disagg"]["num_tokens"] == 59
    [send] = _meta(s.schedule()).sends
    full, window, state = send.block_ids
    assert len(full) == 4 and len(state) == 1 and len(window) == 4
    assert window[0] == 0 and all(window[1:])  # tokens 0..15 left the window: the null block
    s.update_from_output(s.schedule(), u.create_model_runner_output([], finished_sending={req.request_id}))
    pool = s.kv_cache_manager.block_pool  # every block back (vLLM's own count on its null block 0 goes
    assert not s.requests and pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # negative with nulls)
    assert [b.block_id for b in pool.blocks if b.ref_cnt and b.block_id != 0] == []


def test_hybrid_consumer_loads_every_groups_blocks_and_a_failure_goes_by_request(vllm_utils, tiny_llama):
    u = vllm_utils
    s = _hybrid_scheduler(u, tiny_llama, "kv_consumer", "recompute")
    req = u.create_request(num_tokens=60, block_size=BS)
    req.kv_transfer_params = RemotePrefill(7, BOOT, 59).to_params()
    s.add_request(req)
    [load] = _meta(s.schedule()).loads
    full, window, state = load.block_ids
    assert (load.first_token, load.num_tokens) == (0, 59)
    assert len(full) == 4 and len(window) == 3 and len(state) == 1  # the window's last blocks, the slot
    out = u.create_model_runner_output([], finished_recving={req.request_id})
    out.kv_connector_output.failed_recving = {req.request_id}
    s.update_from_output(s.schedule(), out)
    out = s.schedule()  # recomputed, not run on blocks it believes loaded
    assert out.num_scheduled_tokens[req.request_id] == 60
