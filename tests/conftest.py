"""Shared fixtures. Pools are built on DISAGG_TEST_DEVICE (default: cpu); tests marked `gpu`
are deselected (not skipped) where no CUDA device exists."""

import os
import time

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("gpu") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def device() -> str:
    dev = os.environ.get("DISAGG_TEST_DEVICE", "cpu")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"DISAGG_TEST_DEVICE={dev} but torch sees no CUDA device")
    return dev


def _eventually(check, timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll `check` until it is true; fail with `what` after `timeout` seconds. (Waiting for a
    condition with a deadline: the one place tests sleep, and never instead of a condition.)"""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(interval)


@pytest.fixture(scope="session")
def eventually():
    return _eventually
