"""A peer that died, and a new process on its ports (issue 40: the suite saw writes read EOF
where their ack should be). Mooncake keeps what an engine learnt of a session, and pooled
data connections per (host, data port), for the engine's life; transfer/transports/mooncake.py
("Restarted peers") says how a transport copes. Real Mooncake and real peer processes, all in
a network namespace of the test's own that keeps no TIME_WAIT (net.ipv4.tcp_max_tw_buckets=0),
so a new process can take a dead one's ports at once (harness/restarts.py runs them)."""

import json
import os
import subprocess
import sys

import pytest

from harness.peer_client import HARNESS_PATH
from harness.restarts import KINDS

pytestmark = pytest.mark.twonode


@pytest.fixture
def netns():
    name = f"dgrestart{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(["ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv4.tcp_max_tw_buckets=0"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=True)


def test_every_write_to_a_peer_on_a_dead_ones_ports_lands(netns):
    """Without the remedies each kind fails (measured): the same session and data port reads
    EOF on the pooled connections; a new session on the dead one's data port too; the same
    session on a new data port writes to the old port, from the engine's cached segment."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(HARNESS_PATH))
    run = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-m", "harness.restarts"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(got["met"].get(k) for k in KINDS), got
    assert got["engines"] > 1, "a known session came back and no spare engine wrote to it"
