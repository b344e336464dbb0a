"""Shared fixtures. Pools are built on DISAGG_TEST_DEVICE (default: cpu); tests marked `gpu`
are deselected (not skipped) where no CUDA device exists."""

import importlib.util
import os
import time

import pytest
import torch
import zmq

from disagg.control.auth import AuthKey, Gate


# tests/vllm_connector needs vLLM, which has a venv of its own (.venv-vllm: scripts/setup.sh --with vllm;
# scripts/test.sh runs them there): the main venv does not collect them.
def _has_vllm() -> bool:
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None  # (not a folder named vllm on the path)


collect_ignore = [] if _has_vllm() else ["vllm_connector"]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    keep, drop = [], []
    for item in items:
        (drop if item.get_closest_marker("gpu") else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session", autouse=True)
def deployment_key(tmp_path_factory) -> AuthKey:
    """Every process a test starts holds this key (DISAGG_AUTH_KEY): the stacks run with auth on.
    In-process servers built from a config default to no key."""
    path = str(tmp_path_factory.mktemp("keys") / "deployment.key")
    key = AuthKey.generate(path)
    before = os.environ.get("DISAGG_AUTH_KEY")
    os.environ["DISAGG_AUTH_KEY"] = path
    yield key
    if before is None:
        os.environ.pop("DISAGG_AUTH_KEY", None)
    else:
        os.environ["DISAGG_AUTH_KEY"] = before


@pytest.fixture(scope="session")
def keyed(deployment_key):
    """A gate holding the deployment's key, on a context of its own: `keyed.client(sock, name)`
    lets a test's raw socket talk to the processes it started."""
    gate = Gate(zmq.Context(), deployment_key, "test")
    yield gate
    gate.close()
    gate.ctx.destroy(linger=0)  # closes what a test left open (term() would wait for it forever)


@pytest.fixture()
def stranger(tmp_path):
    """A gate with a key of its own (not the deployment's), on its own context: a peer that
    does not belong to the deployment."""
    gate = Gate(zmq.Context(), AuthKey.generate(str(tmp_path / "other.key")), "stranger")
    yield gate
    gate.close()
    gate.ctx.destroy(linger=0)


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
