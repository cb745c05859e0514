"""Addresses as every role reads and writes them (``mooncake_jax.addresses``), and servers bound to IPv6 hosts.

Before one reader existed, five hand-written parsers disagreed: a bare IPv6 advertised host read as HOST:PORT (its
last group taken as the port), and the Conductor, the Messenger and the instances bound ``::1:0`` for host ``::1``
(no brackets), which gRPC cannot read as host and port.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mooncake_jax.addresses import host_of, is_loopback, is_wildcard, join, resolves_to_loopback, split
from mooncake_jax.conductor.api import PolicyConfig
from mooncake_jax.conductor.service import ConductorServer, ConductorService
from mooncake_jax.instance.config import InstanceConfig
from mooncake_jax.instance.server import advertised_address
from mooncake_jax.roles import parse_address


@pytest.mark.parametrize("text, expected", [
    ("10.0.0.7:50051", ("10.0.0.7", "50051")),
    ("pod-1.prefill.svc:7000", ("pod-1.prefill.svc", "7000")),
    ("pod-1.prefill.svc", ("pod-1.prefill.svc", "")),
    ("[::1]:0", ("::1", "0")),
    ("[fd00::5]", ("fd00::5", "")),
    ("fd00::5", ("fd00::5", "")),  # a bare IPv6 address has no port: its last group is the address's
    ("::", ("::", "")),
    ("ipv4:10.0.0.2:5123", ("10.0.0.2", "5123")),  # gRPC's context.peer()
    ("ipv6:[::1]:5123", ("::1", "5123")),
    (" 10.0.0.7:1 ", ("10.0.0.7", "1")),
    ("host:", ("host", "")),
    ("", ("", "")),
])
def test_split_reads_every_form(text, expected):
    assert split(text) == expected
    assert host_of(text) == expected[0]


def test_join_brackets_ipv6_hosts_only():
    assert join("10.0.0.7", 5) == "10.0.0.7:5"
    assert join("::1", 5) == "[::1]:5"
    assert join("[::1]", "5") == "[::1]:5"
    assert join("::", 0) == "[::]:0"
    for host in ("10.0.0.7", "::1", "pod.svc", "fd00::5"):
        assert split(join(host, 7)) == (host, "7")


def test_wildcards_and_loopback():
    assert all(is_wildcard(h) for h in ("", "0.0.0.0", "::", "[::]"))
    assert not any(is_wildcard(h) for h in ("127.0.0.1", "10.0.0.1", "pod.svc"))
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("10.0.0.1", "0.0.0.0", "pod.svc", ""))
    assert resolves_to_loopback("localhost") and resolves_to_loopback("127.0.0.3")
    assert not resolves_to_loopback("no-such-host.invalid") and not resolves_to_loopback("10.0.0.1")


def test_advertised_addresses_keep_ipv6_hosts_whole():
    assert advertised_address("fd00::5", "0.0.0.0", 7000) == "[fd00::5]:7000"  # was "fd00::5": port 5
    assert advertised_address("[fd00::5]:80", "::", 7000) == "[fd00::5]:80"
    assert advertised_address("", "::", 7000) == "[::]:7000"
    assert advertised_address("", "::1", 7000) == "[::1]:7000"
    assert advertised_address("pod:9", "", 1) == "pod:9"
    assert InstanceConfig(role="decode", advertise="fd00::5").advertised_host == "fd00::5"
    assert InstanceConfig(role="decode", advertise="[fd00::5]:80").advertised_host == "fd00::5"
    assert InstanceConfig(role="decode", host="0.0.0.0").advertised_host is None
    assert InstanceConfig(role="decode", host="::").advertised_host is None
    assert InstanceConfig(role="decode", advertise="[fd00::5]:80").data_advertise == "fd00::5"
    assert InstanceConfig(role="decode", host="10.0.0.1").data_advertise is None  # the plane names its bound host
    assert parse_address("[::1]:0", "--listen") == ("::1", 0)
    with pytest.raises(ValueError, match="--listen must be HOST:PORT"):
        parse_address("fd00::5", "--listen")


def test_a_conductor_listens_and_answers_on_an_ipv6_loopback():
    server = ConductorServer(ConductorService(PolicyConfig()), host="::1", port=0, sweep=False).start()
    try:
        assert server.address == f"[::1]:{server.port}"
        with grpc.insecure_channel(server.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(grace_s=0)
