"""``hex.relay.bind_interface``: the receiver resolves an interface name to its IPv4 address on its own machine."""

from __future__ import annotations

import socket

import psutil
import pytest

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.transport.wire import interface_address


def _missing_interface() -> str:
    names = set(psutil.net_if_addrs())
    return next(f"hexnone{i}" for i in range(100) if f"hexnone{i}" not in names)


def test_loopback_resolves_to_127_0_0_1():
    assert interface_address("lo") == "127.0.0.1"


def test_missing_interface_names_the_field_and_lists_the_real_ones():
    with pytest.raises(HexError) as raised:
        interface_address(_missing_interface())
    assert raised.value.field == "hex.relay.bind_interface"
    assert socket.gethostname() in raised.value.problem
    assert "lo" in raised.value.fix.split("use one of ", 1)[1]


@pytest.mark.integration
def test_receiver_bound_by_interface_listens_there_and_takes_a_version(tmp_path, monkeypatch):
    pytest.importorskip("areal")
    from areal.api.cli_args import InferenceEngineConfig

    from areal_hex_plugin.transport.route import Endpoint, PoolRoute, Route
    from areal_hex_plugin.transport.sender import RelaySender, SenderConfig
    from tests.transport.harness import TOKEN, in_buckets, small_qwen2_state_dict
    from tests.transport.receiver_engine import ReceiverEngine
    from tests.transport.sglang_standin import SGLangStandIn

    monkeypatch.setenv("AREAL_HEX_TRANSPORT_TOKEN", TOKEN.decode())
    server = SGLangStandIn(tp_size=1)
    engine = ReceiverEngine(
        InferenceEngineConfig(experiment_name="hex", trial_name="t", pause_grace_period=0.0, setup_timeout=30)
    )
    engine.initialize(addr=server.address, train_data_parallel_size=1)
    try:
        with pytest.raises(HexError, match="hex.relay.bind_interface"):
            engine.hex_start_receiver(bind_interface=_missing_interface(), stage_dir=str(tmp_path))
        endpoint = Endpoint.parse(engine.hex_start_receiver(bind_interface="lo", stage_dir=str(tmp_path)))
        assert endpoint.host == "127.0.0.1"
        listening = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        }
        assert ("127.0.0.1", endpoint.port) in listening
        sender = RelaySender(Route([PoolRoute("lo", [endpoint], 1.5, 5.0)]), SenderConfig(), token=TOKEN)
        report = sender.send_version(3, in_buckets(small_qwen2_state_dict(seed=1), per_bucket=8))
        sender.close()
        assert report.committed == [str(endpoint)]
        assert engine.get_version() == 3
    finally:
        engine.hex_stop_receiver()
        engine.destroy()
        server.close()
