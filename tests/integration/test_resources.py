"""Long-running workers must not grow file descriptors per request (each HTTP request runs
on its own thread; a socket per thread once leaked one descriptor per request)."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from disagg.tools.launcher import Launcher
from disagg.router.router import post_json

pytestmark = pytest.mark.slow


def test_file_descriptors_do_not_grow_with_requests():
    with Launcher() as launcher:
        prefill = launcher.start(
            "prefill", "--preset", "tiny-hybrid", "--device", "cpu", "--bootstrap-bind", "tcp://127.0.0.1:*"
        )
        decode = launcher.start(
            "decode", "--preset", "tiny-hybrid", "--device", "cpu", "--bootstrap-addr", prefill["bootstrap"]
        )
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
        workers = launcher.procs[:2]

        def run(n: int) -> bool:
            with ThreadPoolExecutor(6) as pool:
                return all(
                    pool.map(
                        lambda i: post_json(router["http"] + "/generate", {"prompt_len": 30 + i}, 60)["ok"], range(n)
                    )
                )

        def fds() -> list[int]:
            return [len(os.listdir(f"/proc/{p.pid}/fd")) for p in workers]

        assert run(30)
        before = fds()
        assert run(200)
        after = fds()
        assert all(a <= b + 4 for a, b in zip(after, before)), (before, after)
