"""What one workload run is: the phases a router answer times, what each measures, and a run
as sent. Shared by `disagg bench` (which sends and summarizes runs) and its plot (which draws
them), so neither imports the other for them."""

from dataclasses import dataclass

PHASES = (
    "total",
    "bootstrap",
    "prefill",
    "transfer",
    "transfer_cpu",
    "kv_ready_after_compute",
    "control",
    "wait",
    "verify",
    "decode",
    "rebuild",
    "check",
)
# What each timings_ms key of a router answer measures (disagg/router/router.py merges them);
# the summary's legend prints the line of every phase in its table.
PHASE_MEANING = {
    "total": "router: the whole request, both sides, as the router saw it",
    "bootstrap": "decode: request in -> its prefill peer known (a lookup; ~0 once cached)",
    "prefill": "prefill: request in -> prompt KV computed into its pool (with any wait for pool space)",
    "transfer": "prefill: the transport moving the KV into decode's pool",
    "transfer_cpu": "prefill: CPU time of the thread that sent the KV (planning, submitting, waiting that "
    "spins), the host work a streamed send puts beside the compute",
    "kv_ready_after_compute": "prefill compute done (its last rank that sends KV) -> KV ready on decode: what "
    "layer-wise streaming hides (the part of the transfer after compute + control)",
    "control": "hand-off overhead: the last KV write ended (any prefill rank) -> KV ready on decode "
    "(TransferDone's trip and decode's loop)",
    "wait": "decode: destination sent to prefill -> KV arrived; runs alongside prefill, so it holds the rest "
    "of prefill + transfer + control",
    "verify": "decode: checking that the KV received is this prompt's (the stand-in engine compares every "
    "byte), a digest per component",
    "decode": "decode: generating --max-new-tokens tokens from the received KV (rebuild included; on a model "
    "engine's TP rank also the prompt computed for the other ranks' units)",
    "rebuild": "decode, model engine: reading the pool into the model's cache before the first step",
    "check": "decode, --check-rate: the same prompt run colocated and compared (tokens; logits too where the "
    "engine has them: the model engine, not the stand-in)",
}


@dataclass(frozen=True)
class Run:
    """One workload as sent: each answer, when it came (s since the start), and the wall time."""

    label: str  # "" for a single run; stream_off / stream_on with --stream-layers both
    results: list[dict]
    finished: list[float]
    wall: float
