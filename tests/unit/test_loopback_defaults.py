"""What listens binds loopback unless asked: Flower, `ib up`'s metrics endpoint and gateway."""

from __future__ import annotations

import socket

from ops.flower.process import FlowerProcess
from ops.local.fleet import LocalFleet, serve_host_metrics
from ops.local.processes import GatewayProcess


def test_flower_and_the_gateway_bind_loopback_unless_told():
    assert "--address=127.0.0.1" in FlowerProcess("redis://x", 5555, "a:b").command()
    assert "--address=0.0.0.0" in FlowerProcess("redis://x", 5555, "a:b", address="0.0.0.0").command()
    assert GatewayProcess("redis://x", port=8000).host == "127.0.0.1"
    assert LocalFleet(backends=["llamacpp"]).host == "127.0.0.1"


def test_the_host_metrics_endpoint_listens_on_loopback_only(tmp_path):
    port = serve_host_metrics(0, tmp_path)
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass  # answers on loopback
    outside = outward_address()
    if outside is None:
        return  # this host has no other address to try
    with socket.socket() as s:
        s.settimeout(2)
        assert s.connect_ex((outside, port)) != 0  # and nowhere else


def outward_address() -> str | None:
    """This host's non-loopback address (a UDP connect sends nothing), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address
