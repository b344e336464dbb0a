"""The connector's settings, from vLLM's kv_connector_extra_config (a JSON object on the
command line: every value checked, one line per mistake):

    bootstrap      tcp://host:port   producer: where its workers register (and, with
                                     run_bootstrap, the bootstrap it runs); consumers find it
                                     in each request's kv_transfer_params
    run_bootstrap  true              producer TP rank 0 runs the bootstrap at `bootstrap`
    auth_key       FILE              the deployment's CURVE key (`disagg keygen FILE`; env
    insecure       false               DISAGG_AUTH_KEY / DISAGG_INSECURE=1): one of the two
    host           127.0.0.1         bound and advertised (control socket, Mooncake)
    mooncake_protocol  tcp           tcp or rdma
    cma            true              CPU pools: a peer on this host is written with
                                     process_vm_writev (transfer/transports/cma.py), others
                                     over Mooncake; false: Mooncake for every peer
    hold_s         60                producer: a room waits this long for its consumer's request
    start_s        60                producer: a rank asks the bootstrap this long at start (its
                                     TP ranks start at once; rank 0 runs it), then fails naming it
    load_s         30                consumer: a load fails this long after it was asked
    dead_after_s   5                 a peer silent this long fails its transfers
    quarantine_s   60                consumer: a failed load whose producer may still write (it
                                     gave up on writes in flight, went silent, or was asked to
                                     stop) is reported once it says nothing can land, or after this
    inject_faults  ""                tests only: transfer.faults points, "send.stall=1" (as the
                                     servers' --inject-faults)
"""

import os
from dataclasses import dataclass, fields, replace
from typing import Any

from disagg.control.auth import AuthKey, key_from
from disagg.errors import ConfigError
from transfer.config import TransferConfig
from transfer.faults import FaultPlan


@dataclass(frozen=True)
class ConnectorSettings:
    bootstrap: str | None = None
    run_bootstrap: bool = True
    auth: AuthKey = AuthKey()
    host: str = "127.0.0.1"
    mooncake_protocol: str = "tcp"
    cma: bool = True
    hold_s: float = 60.0
    start_s: float = 60.0
    load_s: float = 30.0
    dead_after_s: float = 5.0
    quarantine_s: float = 60.0
    inject_faults: str = ""

    @staticmethod
    def from_extra(extra: dict[str, Any]) -> "ConnectorSettings":
        known = {f.name for f in fields(ConnectorSettings)} - {"auth"} | {"auth_key", "insecure"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; known: {sorted(known)}")
        key = key_from(
            extra.get("auth_key") or os.environ.get("DISAGG_AUTH_KEY"),
            bool(extra.get("insecure")) or os.environ.get("DISAGG_INSECURE") == "1",
        )
        values = {k: v for k, v in extra.items() if k not in ("auth_key", "insecure")}
        for name in ("hold_s", "start_s", "load_s", "dead_after_s", "quarantine_s"):
            v = values.get(name, 1.0)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ConfigError(f"kv_connector_extra_config.{name}: {v!r} is not a positive number of seconds")
        if not isinstance(values.get("cma", True), bool):
            raise ConfigError(f"kv_connector_extra_config.cma: {values['cma']!r} is not true or false")
        if values.get("mooncake_protocol", "tcp") not in ("tcp", "rdma"):
            raise ConfigError(
                f"kv_connector_extra_config.mooncake_protocol: {values['mooncake_protocol']!r} is not tcp or rdma"
            )
        try:
            if not isinstance(values.get("inject_faults", ""), str):
                raise ValueError(f"{values['inject_faults']!r} is not a string of point=rate")
            FaultPlan.parse(values.get("inject_faults", ""))
        except ValueError as exc:
            raise ConfigError(f"kv_connector_extra_config.inject_faults: {exc}") from None
        return ConnectorSettings(auth=key, **values)

    def transfer_config(self, base: TransferConfig) -> TransferConfig:
        """`base` with the faults to inject (none unless inject_faults says)."""
        return replace(base, faults=FaultPlan.parse(self.inject_faults)) if self.inject_faults else base
