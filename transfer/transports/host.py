"""Which host a process runs on, as same-host transports (cuda-ipc, cma) compare it: the same
value in every process and container on one kernel."""

import socket
from functools import lru_cache


@lru_cache(maxsize=1)
def host_identity() -> str:
    """Boot id plus hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{boot}/{socket.gethostname()}"
