"""kv_connector_extra_config as the connector reads it (disagg.vllm.settings): each mistake one
line. (The deployment key comes from DISAGG_AUTH_KEY, which tests/conftest.py sets.)"""

import pytest

from disagg.errors import ConfigError
from disagg.vllm.settings import ConnectorSettings
from disagg.vllm.worker import TRANSFER


def test_injected_faults_reach_the_transfer_config_and_bad_ones_are_refused_in_one_line():
    plan = ConnectorSettings.from_extra({"inject_faults": "send.stall=1"}).transfer_config(TRANSFER)
    assert plan.faults.rates == {"send.stall": 1.0} and plan.mode is TRANSFER.mode
    assert ConnectorSettings.from_extra({}).transfer_config(TRANSFER) is TRANSFER
    for bad, why in (
        ("nope=1", "unknown fault point 'nope'"),
        (5, "5 is not a string"),
        ("send.stall=x", "'x' for send.stall is not a number"),
    ):
        with pytest.raises(ConfigError, match=f"^kv_connector_extra_config.inject_faults: .*{why}") as exc:
            ConnectorSettings.from_extra({"inject_faults": bad})
        assert "\n" not in str(exc.value)


def test_cpu_pools_offer_cma_before_mooncake_unless_told_not_to():
    """A decode worker on CPU offers cma first (a producer on its host writes its pool with
    process_vm_writev: 32 MiB in ~6 ms where loopback TCP took 31-69 ms), Mooncake second (a
    producer elsewhere); `cma: false` and GPU pools keep what `auto` gives."""
    from transfer.transports import TransportSettings

    from disagg.vllm.worker import transport_names

    assert ConnectorSettings.from_extra({}).cma is True
    assert transport_names(TransportSettings(device="cpu"), True) == ("cma", "mooncake")
    assert transport_names(TransportSettings(device="cpu"), ConnectorSettings.from_extra({"cma": False}).cma) == (
        "mooncake",
    )
    assert transport_names(TransportSettings(device="cuda:0"), True) == ("cuda-ipc", "mooncake")
    with pytest.raises(ConfigError, match="^kv_connector_extra_config.cma: 'yes' is not true or false$"):
        ConnectorSettings.from_extra({"cma": "yes"})


def test_deadlines_are_positive_seconds_and_a_bad_one_is_refused_in_one_line():
    assert ConnectorSettings.from_extra({"start_s": 5}).start_s == 5 and ConnectorSettings().start_s == 60.0
    for name in ("start_s", "hold_s", "load_s"):
        for bad in (0, -1, True, "5"):
            with pytest.raises(ConfigError, match=f"^kv_connector_extra_config.{name}: .* is not a positive") as exc:
                ConnectorSettings.from_extra({name: bad})
            assert "\n" not in str(exc.value)
