"""What listens binds loopback unless asked: Flower, `ib up`'s metrics endpoint and gateway."""

from __future__ import annotations

import psutil

from ops.flower.process import FlowerProcess
from ops.local.fleet import LocalFleet, serve_host_metrics
from ops.local.processes import GatewayProcess


def test_flower_and_the_gateway_bind_loopback_unless_told():
    assert "--address=127.0.0.1" in FlowerProcess("redis://x", 5555, "a:b").command()
    assert "--address=0.0.0.0" in FlowerProcess("redis://x", 5555, "a:b", address="0.0.0.0").command()
    assert GatewayProcess("redis://x", port=8000).host == "127.0.0.1"
    assert LocalFleet(backends=["llamacpp"]).host == "127.0.0.1"


def listening_addresses(port: int) -> set[str]:
    """The addresses this process listens on at ``port``, as the kernel reports them."""
    return {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }


def test_the_host_metrics_endpoint_listens_on_loopback_only(tmp_path):
    """The listening socket's own address, not a connection attempt from an outward
    address (a host without one let that version pass whatever was bound)."""
    port = serve_host_metrics(0, tmp_path)
    assert listening_addresses(port) == {"127.0.0.1"}
    wide = serve_host_metrics(0, tmp_path, addr="0.0.0.0")  # the check sees a wide bind when asked for one
    assert listening_addresses(wide) == {"0.0.0.0"}


def test_ib_serve_binds_loopback_by_default():
    from core.settings import fleet_config

    assert fleet_config().gateway.host == "127.0.0.1"
