"""Every role as its own server (issue 12): the role commands, membership that survives a lost KV event batch and a
Conductor restart, waiting for a Conductor that does not answer, advertised addresses, and TLS.

The index checks compare the Conductor's index with the fake pool's own key sets (the truth the events describe).
"""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mooncake_jax import cli
from mooncake_jax.conductor import PolicyConfig
from mooncake_jax.conductor.index import Tier
from mooncake_jax.conductor.service import messages, serve, services
from mooncake_jax.instance.conductor_link import ConductorLink
from mooncake_jax.instance.server import advertised_address
from mooncake_jax.kv_layout import KVLayout
from mooncake_jax.proto import channel_options, tls
from mooncake_jax.roles import parse_address
from mooncake_jax.transfer.events import BlockEvent, EventKind


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def role(*argv, timeout=60, stdin=subprocess.DEVNULL):
    """Run ``mooncake-jax ARGV`` to its end: (exit status, stdout, stderr)."""
    done = subprocess.run([sys.executable, "-m", "mooncake_jax.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, stdin=stdin)
    return done.returncode, done.stdout, done.stderr


# ---- addresses and flags ------------------------------------------------------------------------------------------

def test_listen_and_advertise_addresses():
    assert parse_address("10.0.0.7:50051", "--listen") == ("10.0.0.7", 50051)
    assert parse_address("[::1]:0", "--listen") == ("::1", 0)
    for bad in ("nohost", ":5", "host:", "host:99999", "host:x"):
        with pytest.raises(ValueError, match="--listen must be HOST:PORT"):
            parse_address(bad, "--listen")
    assert advertised_address("", "0.0.0.0", 7000) == "0.0.0.0:7000"
    assert advertised_address("pod-1.prefill.svc", "0.0.0.0", 7000) == "pod-1.prefill.svc:7000"
    assert advertised_address("203.0.113.5:443", "0.0.0.0", 7000) == "203.0.113.5:443"


def test_role_commands_refuse_bad_input_with_the_reason(capsys):
    assert cli.main(["conductor", "--listen", "nope"]) == 2
    assert "--listen must be HOST:PORT" in capsys.readouterr().err
    assert cli.main(["conductor", "--listen", "0.0.0.0:0"]) == 2  # beyond loopback without the shared token
    assert "beyond loopback" in capsys.readouterr().err
    assert cli.main(["gateway", "--conductor", "127.0.0.1:1", "--grpc-port", "70000"]) == 2
    assert "--grpc-port must be 0-65535" in capsys.readouterr().err
    assert cli.main(["conductor", "--listen", "127.0.0.1:0", "--tls-cert", "/nonexistent.pem"]) == 2
    assert "TLS needs both --tls-cert and --tls-key" in capsys.readouterr().err


def test_conductor_command_serves_until_sigterm():
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_jax.cli", "conductor", "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] and ready["port"] > 0 and ready["address"] == f"127.0.0.1:{ready['port']}"
        with grpc.insecure_channel(ready["address"]) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            listing = services.ConductorStub(channel).ListInstances(messages.ListInstancesRequest(), timeout=10)
            assert list(listing.instances) == [] and listing.model == ""
        proc.terminate()
        assert proc.wait(20) == 0
        assert "Conductor stopping" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_instance_and_gateway_give_up_on_a_silent_conductor_after_the_stated_time():
    silent = f"127.0.0.1:{free_port()}"  # nothing listens there
    t = time.monotonic()
    code, _, err = role("gateway", "--conductor", silent, "--conductor-wait-s", "1.5")
    assert code == 3, err
    assert "does not answer (UNAVAILABLE); retrying in" in err
    assert f"the Conductor at {silent} did not answer within 2 s" in err
    assert time.monotonic() - t < 30
    code, out, err = role("instance", "--role", "prefill", "--conductor", silent, "--conductor-wait-s", "1",
                          "--listen", "127.0.0.1:0")
    assert code == 3 and out == "", err
    assert "retrying in" in err and f"the Conductor at {silent} did not answer within 1 s" in err
    assert "measuring" not in err and "compiled" not in err  # it gave up before loading anything


# ---- KV events numbered per instance --------------------------------------------------------------------------------

class FakePool:
    """The block lists an instance would re-send, and the events its pool would emit."""

    def __init__(self):
        self.dram, self.ssd = set(), set()

    def lists(self):
        return sorted(self.dram), sorted(self.ssd)


@pytest.fixture
def conductor():
    server = serve(PolicyConfig(block_size=16), port=0, sweep=False, heartbeat_interval_s=0.2,
                   heartbeat_timeout_s=5.0)
    yield server
    server.stop(0)


def linked(conductor, pool, instance_id="prefill-a"):
    return ConductorLink(conductor.address, instance_id, "prefill", "10.0.0.1:1", "", 1000, load=lambda: {},
                         block_lists=pool.lists, hardware="8xA800", model="llama2-70b")


def indexed(conductor, instance_id):
    """{key: tier} of what the Conductor's index says ``instance_id`` holds."""
    state = conductor.service.state
    slot = state.instances.slot(instance_id)
    keys = {k for k in range(1, 200) if state.index.tier(k, slot) is not None}
    return {k: state.index.tier(k, slot) for k in keys}


def store(link, pool, keys, tier="dram"):
    for k in keys:
        (pool.dram if tier == "dram" else pool.ssd).add(k)
        link.on_pool_event(BlockEvent(EventKind.STORED, k, tier))


def test_a_batch_lost_on_the_way_is_replaced_by_the_whole_block_list(conductor):
    pool = FakePool()
    link = linked(conductor, pool)
    link._register()
    store(link, pool, [1, 2, 3])
    link._flush_events()
    assert indexed(conductor, "prefill-a") == {1: Tier.DRAM, 2: Tier.DRAM, 3: Tier.DRAM}
    # The next batch fails on the wire (the Conductor is briefly away): it is not re-sent as it was ...
    store(link, pool, [4, 5])
    real = link._stub
    link._stub = _Down()
    with pytest.raises(grpc.RpcError):
        link._flush_events()
    link._stub = real
    pool.dram.discard(1)  # ... and meanwhile the pool changed
    pool.ssd.add(6)
    link._flush_events()  # the whole list replaces the index's view: nothing drifts
    assert indexed(conductor, "prefill-a") == {2: Tier.DRAM, 3: Tier.DRAM, 4: Tier.DRAM, 5: Tier.DRAM, 6: Tier.SSD}
    assert link.resyncs == 1


def test_the_conductor_detects_a_skipped_batch_number_and_asks_for_a_resync(conductor):
    pool = FakePool()
    link = linked(conductor, pool)
    link._register()
    store(link, pool, [1, 2])
    link._flush_events()
    link._seq += 1  # a batch the Conductor never saw (lost without the link knowing)
    pool.dram.add(3)  # its content
    store(link, pool, [4])
    link._flush_events()  # refused: out of sequence; the reply asks for the whole list
    assert conductor.service.resyncs == 1
    assert 4 not in indexed(conductor, "prefill-a")
    link._flush_events()
    assert indexed(conductor, "prefill-a") == {1: Tier.DRAM, 2: Tier.DRAM, 3: Tier.DRAM, 4: Tier.DRAM}
    store(link, pool, [5])  # and numbering goes on from there
    link._flush_events()
    assert 5 in indexed(conductor, "prefill-a") and conductor.service.resyncs == 1


def test_a_restarted_conductor_gets_the_block_lists_back_and_the_numbering_restarts(conductor):
    pool = FakePool()
    link = linked(conductor, pool)
    link._register()
    store(link, pool, [7, 8])
    link._flush_events()
    host, port = conductor.address.rsplit(":", 1)
    conductor.stop(0)
    restarted = serve(PolicyConfig(block_size=16), host=host, port=int(port), sweep=False)
    try:
        store(link, pool, [9])
        with pytest.raises(grpc.RpcError) as e:  # it does not know the instance: register again
            link._flush_events()
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        link._reregister()
        assert indexed(restarted, "prefill-a") == {7: Tier.DRAM, 8: Tier.DRAM, 9: Tier.DRAM}
        store(link, pool, [10])
        link._flush_events()
        assert 10 in indexed(restarted, "prefill-a") and restarted.service.resyncs == 0
    finally:
        link.stop(deregister=False)
        restarted.stop(0)


class _Down:
    """A Conductor stub whose event stream fails on the wire."""

    @staticmethod
    def PublishKvEvents(*args, **kwargs):
        raise _RpcError(grpc.StatusCode.UNAVAILABLE)


class _RpcError(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "test"


def test_a_conductor_started_alone_learns_block_size_and_model_from_the_first_prefill_instance():
    server = serve(None, port=0, sweep=False, adopt_block_size=True)
    try:
        with grpc.insecure_channel(server.address, options=channel_options()) as channel:
            stub = services.ConductorStub(channel)
            layout = KVLayout(n_layers=4, n_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
            stub.Register(messages.RegisterRequest(
                instance_id="p", role=messages.PREFILL, address="a:1", hardware="8xA800", model="llama2-70b",
                kv_layout=layout.to_json(), config_json=json.dumps({"model": "tiny", "role": "prefill"})))
            listing = stub.ListInstances(messages.ListInstancesRequest())
            assert (listing.model, listing.block_size) == ("tiny", 16)
            other = KVLayout(n_layers=4, n_kv_heads=2, head_dim=16, block_size=32, dtype="float32")
            with pytest.raises(grpc.RpcError) as e:  # the second must match the first
                stub.Register(messages.RegisterRequest(
                    instance_id="q", role=messages.PREFILL, address="b:1", hardware="8xA800", model="llama2-70b",
                    kv_layout=other.to_json()))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prefill block_size 32 differs from the cluster's 16" in e.value.details()
            foreign = KVLayout(n_layers=80, n_kv_heads=8, head_dim=128, block_size=16, dtype="float32")
            with pytest.raises(grpc.RpcError) as e:  # another model: refused, saying how it differs
                stub.Register(messages.RegisterRequest(
                    instance_id="d", role=messages.DECODE, address="c:1", hardware="8xA800", model="llama2-70b",
                    kv_layout=foreign.to_json()))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "cannot exchange KV with this cluster" in e.value.details()
    finally:
        server.stop(0)


# ---- TLS ------------------------------------------------------------------------------------------------------------

def self_signed(tmp_path):
    """A self-signed certificate for 127.0.0.1 and localhost, written as PEM files: (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mooncake-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture
def tls_files(tmp_path):
    cert, key = self_signed(tmp_path)
    yield cert, key
    tls.reset()


def test_tls_grpc_and_http(tls_files):
    from test_gateway_support import FakeBackend

    from mooncake_jax.gateway import GatewayServer
    from mooncake_jax.proto.auth import open_channel

    cert, key = tls_files
    with pytest.raises(ValueError, match="not a usable PEM"):
        tls.configure(key, key)
    tls.configure(cert, key)
    conductor = serve(PolicyConfig(block_size=16), port=0, sweep=False, auth_token="s3cret")
    gateway = GatewayServer(FakeBackend(), grpc_port=None, http_port=0, auth_token="s3cret").start()
    try:
        with open_channel(conductor.address, "s3cret") as channel:  # TLS, verified against the certificate
            listing = services.ConductorStub(channel).ListInstances(messages.ListInstancesRequest(), timeout=10)
            assert list(listing.instances) == []
        with grpc.insecure_channel(conductor.address) as plain:  # a clear-text client gets nothing
            with pytest.raises(grpc.RpcError) as e:
                services.ConductorStub(plain).ListInstances(messages.ListInstancesRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        context = ssl.create_default_context(cafile=str(cert))
        https = http.client.HTTPSConnection("127.0.0.1", gateway.http_port, context=context, timeout=10)
        https.request("GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})
        answer = https.getresponse()
        assert answer.status == 200 and json.loads(answer.read())["data"]
        https.close()
        plain_http = http.client.HTTPConnection("127.0.0.1", gateway.http_port, timeout=10)
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            plain_http.request("GET", "/v1/models")
            plain_http.getresponse().read()
        plain_http.close()
    finally:
        gateway.stop(0)
        conductor.stop(0)


def test_conductor_command_serves_tls_only(tmp_path):
    cert, key = self_signed(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_jax.cli", "conductor", "--listen", "127.0.0.1:0",
                             "--tls-cert", str(cert), "--tls-key", str(key)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        address = json.loads(proc.stdout.readline())["address"]
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(address, credentials) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(address) as plain:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=5)
        proc.terminate()
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
