"""The scheduler side of DisaggConnector, without vLLM: what a step's metadata tells the
workers, from the calls vLLM's scheduler makes.

    producer (prefill)                         consumer (decode)
    request_finished(completed, blocks)        get_num_new_matched_tokens: prompt tokens
      -> hold the blocks under a new room        beyond the local prefix-cache hit, async
      -> params naming room + bootstrap        update_state_after_alloc: the destination
    build_meta: Send(room, blocks)               blocks of those tokens -> Load
      (the worker keeps them until the         request_finished before the load ended:
       consumer asked and the KV went, or        Release (the producer stops and frees);
       its hold deadline passed; then it        vLLM itself keeps the blocks until the
       reports finished_sending)                 worker reports the load finished

The request object is vLLM's (request_id, kv_transfer_params, num_prompt_tokens), read only.
A KV cache group is one block table (HMA: full attention, sliding window, Mamba); block ids
travel per group, each group's selected as disagg.vllm.groups says (a window's last blocks, a
state's slot). A model with a state group (Mamba/GDN) hands over the state after the
prompt's last token but one: the producer computes one token less (`backoff`), and the
consumer computes the last itself from that state, as vLLM's NixlConnector does.
"""

import logging
from dataclasses import dataclass, field
from typing import Any

from disagg.vllm.groups import Group, Kind
from disagg.vllm.params import ParamsError, RemotePrefill, new_room, remote_prefill, wants_remote_decode

log = logging.getLogger(__name__)

BlockIds = tuple[tuple[int, ...], ...]  # per KV cache group


@dataclass(frozen=True)
class Send:
    """Producer: a finished prompt's blocks, held under `room` until a consumer takes them."""

    req_id: str
    room: int
    num_tokens: int
    block_ids: BlockIds


@dataclass(frozen=True)
class Load:
    """Consumer: tokens [first_token, first_token + num_tokens) of the prompt come from the
    producer into `block_ids` (per group: the blocks of exactly those tokens)."""

    req_id: str
    remote: RemotePrefill
    first_token: int
    num_tokens: int
    block_ids: BlockIds


@dataclass(frozen=True)
class Release:
    """Consumer: the producer may stop and free `remote.room` (aborted, or nothing to load);
    `req_id` is set when a load of ours is under way and must be reported finished."""

    remote: RemotePrefill
    reason: str
    req_id: str | None = None


@dataclass
class StepMeta:
    """What one scheduler step tells the workers."""

    sends: list[Send] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    releases: list[Release] = field(default_factory=list)


class DisaggScheduler:
    def __init__(self, groups: tuple[Group, ...], producer: bool, consumer: bool, bootstrap: str | None):
        if producer and not bootstrap:
            raise ValueError(
                "a kv_producer needs kv_connector_extra_config.bootstrap (tcp://host:port of its "
                "bootstrap, which consumers look its workers up at)"
            )
        if not groups:
            raise ValueError("no KV cache groups")
        self.groups, self.producer, self.consumer, self.bootstrap = groups, producer, consumer, bootstrap
        self.backoff = 1 if any(g.kind is Kind.STATE for g in groups) else 0
        self._local_hit: dict[str, tuple[RemotePrefill, int]] = {}  # consumer: asked, not yet allocated
        self._loading: dict[str, RemotePrefill] = {}  # consumer: load handed to the workers
        self._taken: set[str] = set()  # consumer: params used (once per request)
        self._meta = StepMeta()

    # ---- consumer ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens the producer holds beyond our own prefix-cache hit, loaded async."""
        if not self.consumer or request.request_id in self._taken:
            return 0, False
        remote = self._remote(request)
        if remote is None:
            return 0, False
        self._local_hit[request.request_id] = (remote, num_computed_tokens)
        count = min(remote.num_tokens, request.num_prompt_tokens - self.backoff) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, block_ids: BlockIds, num_external_tokens: int) -> None:
        """Record the destination blocks of the tokens to load (or release the producer's hold
        when nothing is to be loaded)."""
        asked = self._local_hit.pop(request.request_id, None)
        if asked is None or request.request_id in self._taken:
            return
        self._taken.add(request.request_id)
        remote, first = asked
        if num_external_tokens <= 0:
            self._meta.releases.append(Release(remote, "decode holds every prompt token already"))
            return
        blocks = tuple(g.wanted(b, first, num_external_tokens) for g, b in zip(self.groups, block_ids, strict=True))
        self._meta.loads.append(Load(request.request_id, remote, first, num_external_tokens, blocks))
        self._loading[request.request_id] = remote

    def loaded(self, req_ids: set[str]) -> None:
        """The workers reported these loads finished (ok or not)."""
        for r in req_ids:
            self._loading.pop(r, None)

    def truncate(self, request: Any) -> int:
        """Producer: prompt tokens to leave to the consumer (a state group's backoff: the
        request is prefilled without them); 0 for anything else."""
        if not (self.producer and self.backoff and wants_remote_decode(request.kv_transfer_params)):
            return 0
        return self.backoff if request.num_prompt_tokens > self.backoff else 0

    def _remote(self, request: Any) -> RemotePrefill | None:
        try:
            return remote_prefill(request.kv_transfer_params)
        except ParamsError as exc:
            log.warning("request %s: %s; computing its prompt here", request.request_id, exc)
            return None

    # ---- both -------------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: BlockIds, completed: bool) -> tuple[bool, dict | None]:
        """Producer: hold a completed prompt's blocks under a new room (True: vLLM frees them
        once the workers report the send finished) and name it in the params. Consumer: a
        request that ends with its load under way or never started releases the room."""
        req_id = request.request_id
        self._local_hit.pop(req_id, None)
        if self.consumer and req_id not in self._taken:
            remote = self._remote(request)
            if remote is not None:  # never allocated: the producer still holds the room
                self._meta.releases.append(Release(remote, "the request ended on decode before it was scheduled"))
        self._taken.discard(req_id)
        remote = self._loading.pop(req_id, None)
        if remote is not None:  # vLLM keeps the blocks until the workers report the load finished
            self._meta.releases.append(Release(remote, "the request was aborted on decode", req_id))
        if not (self.producer and completed and wants_remote_decode(request.kv_transfer_params)):
            return False, None
        blocks = tuple(g.held(b) for g, b in zip(self.groups, block_ids, strict=True))
        if not any(blocks):
            return False, None
        room = new_room()
        num_tokens = request.num_computed_tokens
        self._meta.sends.append(Send(req_id, room, num_tokens, blocks))
        return True, RemotePrefill(room, self.bootstrap, num_tokens).to_params()

    def build_meta(self) -> StepMeta:
        """This step's metadata; the next step starts empty."""
        meta, self._meta = self._meta, StepMeta()
        return meta
