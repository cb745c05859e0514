"""``data_plane="auto"``, the default (issue 15 point 4, sixteenth pass): block moves between two current builds go
on the socket plane; a peer that does not serve it (configured "grpc", an older build that says nothing, TLS, a data
port it cannot reach) gets gRPC, bit-exact and without waiting for a deadline; the plane listens on the host the
instance listens on and its offers name a host the peer can reach."""

import logging
import socket
import threading
from types import SimpleNamespace

import grpc
import pytest
from test_messenger import SPEC, assert_exact, filled_pool, free_port

from mooncake_jax.instance.config import InstanceConfig
from mooncake_jax.instance.main import parse_args
from mooncake_jax.instance.server import InstanceServer
from mooncake_jax.proto import tls
from mooncake_jax.transfer import BlockPool
from mooncake_jax.transfer import socket_plane as socket_plane_module
from mooncake_jax.transfer.device_plane import device_plane
from mooncake_jax.transfer.frame import frame_bytes
from mooncake_jax.transfer.messenger import MessengerClient, MessengerServer, TransferError, messages, services
from mooncake_jax.transfer.messenger_server import _Servicer
from mooncake_jax.transfer.socket_plane import PullError, SocketPlane, resolve, socket_plane

KEYS = list(range(1, 41))
SHORT_S = 8.0
"""A move's deadline in these tests: a fallback that waited for a deadline would fail the move instead."""


@pytest.fixture
def servers():
    """``start(pool, **MessengerServer options)`` on a free port (host 127.0.0.1 unless given); stopped after."""
    started = []

    def start(pool: BlockPool, host: str = "127.0.0.1", **options) -> MessengerServer:
        server = MessengerServer(pool, host=host, port=free_port(), **options).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop(grace_s=0)


def moves_both_ways(servers, **server_options):
    """Fetch half of KEYS from a peer and push the rest to it with default clients; both pools checked exact.
    Returns (the peer's server, the fetching client's counters, the pushing client's counters)."""
    a, b = filled_pool(KEYS), BlockPool(SPEC)
    server = servers(a, **server_options)
    with MessengerClient(server.address, b, timeout_s=SHORT_S) as fetcher:
        assert fetcher.data_plane == "auto"
        assert fetcher.fetch(KEYS[:20]).moved == KEYS[:20]
        fetched = fetcher.counters
    assert_exact(b, KEYS[:20])
    c = filled_pool(KEYS)
    receiver = servers(BlockPool(SPEC), **server_options)
    with MessengerClient(receiver.address, c, timeout_s=SHORT_S) as pusher:
        assert pusher.push(KEYS[20:]).moved == KEYS[20:]
        pushed = pusher.counters
    assert_exact(receiver.pool, KEYS[20:])
    return server, receiver, fetched, pushed


def test_auto_moves_blocks_on_the_socket_plane_between_current_builds(servers):
    server, receiver, fetched, pushed = moves_both_ways(servers)
    n_bytes = 20 * frame_bytes(SPEC)
    assert fetched.socket_bytes == n_bytes and fetched.plane_fallbacks == 0
    assert pushed.socket_bytes == n_bytes and pushed.plane_fallbacks == 0
    assert server.counters.socket_bytes == n_bytes  # the peer offered them on its socket plane
    assert receiver.counters.socket_bytes == n_bytes  # and the receiver pulled them from the pusher's


@pytest.mark.parametrize("peer", ["configured grpc", "older build"])
def test_a_peer_without_the_socket_plane_gets_grpc_bit_exact(servers, monkeypatch, caplog, peer):
    if peer == "older build":  # its HasReply has no data_planes field: it never heard of them
        monkeypatch.setattr(_Servicer, "_data_planes", lambda self, context: [])
    options = {"serve_socket": False} if peer == "configured grpc" else {}
    with caplog.at_level(logging.INFO, logger="mooncake_jax.transfer.messenger"):
        server, receiver, fetched, pushed = moves_both_ways(servers, **options)
    assert fetched.socket_bytes == pushed.socket_bytes == 0
    assert fetched.plane_fallbacks == pushed.plane_fallbacks == 1
    assert server.counters.socket_bytes == receiver.counters.socket_bytes == 0
    said = [r.getMessage() for r in caplog.records if "not the socket data plane" in r.getMessage()]
    assert len(said) == 2 and all("the peer does not serve it" in line for line in said)  # one per client


def test_a_socket_move_refused_after_all_goes_on_over_grpc_and_is_not_tried_again(servers, monkeypatch, caplog):
    """A peer that lists the plane but refuses it when asked (a stale answer, a data port it cannot reach):
    FAILED_PRECONDITION before anything moved, so the move goes on over gRPC, said once."""
    monkeypatch.setattr(_Servicer, "_data_planes", lambda self, context: ["grpc", "jax", "socket"])
    a, b = filled_pool(KEYS), BlockPool(SPEC)
    server = servers(a, serve_socket=False)
    with caplog.at_level(logging.INFO, logger="mooncake_jax.transfer.messenger"):
        with MessengerClient(server.address, b, timeout_s=SHORT_S) as client:
            assert client.fetch(KEYS[:10]).moved == KEYS[:10]
            assert client.fetch(KEYS[10:20]).moved == KEYS[10:20]
            assert client.plane() == "grpc"
            assert client.counters.plane_fallbacks == 2 and client.counters.socket_bytes == 0
    assert_exact(b, KEYS[:20])
    said = [r.getMessage() for r in caplog.records if "not the socket data plane" in r.getMessage()]
    assert len(said) == 1 and "FAILED_PRECONDITION" in said[0] and "configured data_plane" in said[0]
    receiver = servers(b, serve_socket=False)
    with MessengerClient(receiver.address, filled_pool(KEYS), timeout_s=SHORT_S) as pusher:
        assert pusher.push(KEYS).moved == KEYS[20:]
        assert pusher.counters.plane_fallbacks == 1 and pusher.counters.socket_bytes == 0
    assert_exact(b, KEYS)


def test_an_offer_this_end_cannot_connect_to_moves_over_grpc(servers, monkeypatch):
    """The peer's offer names a data port nothing listens on (a firewall, a stale address): the pull fails to
    connect, nothing moved, and the fetch goes on over gRPC; explicit "socket" reports it instead."""
    closed = free_port()
    real_offer = SocketPlane.offer
    monkeypatch.setattr(SocketPlane, "offer", lambda self, *a, **k: (f"127.0.0.1:{closed}",
                                                                    real_offer(self, *a, **k)[1]))
    a = filled_pool(KEYS)
    server = servers(a)
    b = BlockPool(SPEC)
    with MessengerClient(server.address, b, timeout_s=SHORT_S) as client:
        assert client.fetch(KEYS).moved == KEYS
        assert client.counters.plane_fallbacks == 1 and client.counters.socket_bytes == 0
    assert_exact(b, KEYS)
    with MessengerClient(server.address, BlockPool(SPEC), timeout_s=SHORT_S, data_plane="socket") as client:
        with pytest.raises(TransferError, match="cannot connect"):
            client.fetch(KEYS)



def test_an_offer_on_a_port_that_drops_connections_moves_over_grpc_within_the_deadline(servers, monkeypatch):
    """The peer's offer names a data port whose connections hang (a listener whose accept queue is full: the kernel
    drops further SYNs, as a firewall does): the connect gives up after part of the deadline, and the fetch goes on
    over gRPC in the rest of it instead of failing at the deadline."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(0)
    filler = socket.create_connection(hole.getsockname(), timeout=1.0)  # fills the accept queue: the next SYN hangs
    real_offer = SocketPlane.offer
    monkeypatch.setattr(SocketPlane, "offer", lambda self, *a, **k: (f"127.0.0.1:{hole.getsockname()[1]}",
                                                                    real_offer(self, *a, **k)[1]))
    try:
        server = servers(filled_pool(KEYS))
        b = BlockPool(SPEC)
        with MessengerClient(server.address, b, timeout_s=SHORT_S) as client:
            assert client.fetch(KEYS).moved == KEYS
            assert client.counters.plane_fallbacks == 1 and client.counters.socket_bytes == 0
        assert_exact(b, KEYS)
    finally:
        filler.close()
        hole.close()

@pytest.fixture
def tls_on(tmp_path):
    from test_roles import self_signed

    cert, key = self_signed(tmp_path)
    tls.configure(cert, key)
    yield
    tls.reset()


def test_with_tls_auto_keeps_grpc_and_the_peer_does_not_offer_the_socket_plane(servers, tls_on):
    """The chosen behaviour with TLS: gRPC (over TLS) for the blocks, never the socket plane in clear text."""
    server, receiver, fetched, pushed = moves_both_ways(servers)
    assert fetched.socket_bytes == pushed.socket_bytes == 0
    assert fetched.plane_fallbacks == pushed.plane_fallbacks == 1
    assert server.counters.socket_bytes == 0
    with MessengerClient(server.address, BlockPool(SPEC)) as client:  # a TLS channel: the peer's own answer
        assert list(client._has([], None).data_planes) == ["grpc", "jax"]
        assert client.plane() == "grpc"
    with pytest.raises(ValueError, match="does not support TLS"):
        MessengerClient(server.address, BlockPool(SPEC), data_plane="socket")


def test_the_plane_listens_on_the_servers_host_and_offers_name_it(servers, monkeypatch):
    """A server on 127.0.0.2 (all of 127/8 is loopback here) offers from a listener bound to 127.0.0.2, not
    127.0.0.1; a client given data_host 127.0.0.3 offers its pushes from there."""
    connected = []
    real_connect = socket.create_connection

    def spy(address, *args, **kwargs):
        connected.append(address)
        return real_connect(address, *args, **kwargs)

    monkeypatch.setattr(socket_plane_module.socket, "create_connection", spy)
    a, b = filled_pool(KEYS), BlockPool(SPEC)
    server = servers(a, host="127.0.0.2")
    with MessengerClient(server.address, b, timeout_s=SHORT_S, data_host="127.0.0.3") as client:
        assert client.fetch(KEYS[:20]).moved == KEYS[:20]
        assert client.counters.socket_bytes > 0
    assert {host for host, _ in connected} == {"127.0.0.2"}
    assert socket_plane("127.0.0.2")._listener.getsockname()[0] == "127.0.0.2"
    assert_exact(b, KEYS[:20])
    connected.clear()
    receiver = servers(b, host="127.0.0.2")
    with MessengerClient(receiver.address, filled_pool(KEYS), timeout_s=SHORT_S, data_host="127.0.0.3") as client:
        assert client.push(KEYS).moved == KEYS[20:]
        assert client.counters.socket_bytes > 0
    assert {host for host, _ in connected} == {"127.0.0.3"}  # the receiver pulled from the pusher's 127.0.0.3
    assert socket_plane("127.0.0.3")._listener.getsockname()[0] == "127.0.0.3"
    assert_exact(b, KEYS)


def test_a_wildcard_listener_is_reached_at_the_host_the_peer_was_reached_at(servers, monkeypatch):
    """A server bound to every address (0.0.0.0), nothing advertised: its offers name 0.0.0.0, which the puller
    replaces with the host it reached the server's gRPC at (never 0.0.0.0 or its own loopback elsewhere)."""
    connected = []
    real_connect = socket.create_connection
    monkeypatch.setattr(socket_plane_module.socket, "create_connection",
                        lambda address, *a, **k: connected.append(address) or real_connect(address, *a, **k))
    grpc_server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(4))
    from mooncake_jax.transfer.messenger_server import add_messenger

    a, b = filled_pool(KEYS), BlockPool(SPEC)
    meter = add_messenger(grpc_server, a, data_host="0.0.0.0")
    port = grpc_server.add_insecure_port("127.0.0.4:0")
    grpc_server.start()
    try:
        with MessengerClient(f"127.0.0.4:{port}", b, timeout_s=SHORT_S) as client:
            assert client.fetch(KEYS).moved == KEYS
    finally:
        grpc_server.stop(0)
    assert_exact(b, KEYS)
    assert meter.snapshot().socket_bytes == len(KEYS) * frame_bytes(SPEC)
    assert {host for host, _ in connected} == {"127.0.0.4"}
    assert resolve("0.0.0.0:5000", "10.1.2.3") == "10.1.2.3:5000"
    assert resolve("[::]:5000", "fd00::2") == "[fd00::2]:5000"
    assert resolve("10.9.9.9:5000", "10.1.2.3") == "10.9.9.9:5000"


def test_a_loopback_plane_is_not_offered_to_another_host_nor_pulled_from_there():
    assert not SocketPlane("127.0.0.1").reachable_from("10.0.0.2")
    assert SocketPlane("127.0.0.1").reachable_from("127.0.0.1")
    assert SocketPlane("127.0.0.1", advertise="10.0.0.1").reachable_from("10.0.0.2")
    assert SocketPlane("0.0.0.0").reachable_from("10.0.0.2")
    assert SocketPlane("10.0.0.1").reachable_from("10.0.0.2")
    with pytest.raises(PullError, match="its own loopback") as caught:  # never tried on this host's loopback
        SocketPlane().pull("127.0.0.1:1", bytes(16), 1, 100, lambda *a: None, 5.0, peer_host="10.0.0.2")
    assert not caught.value.connected


def test_a_client_only_process_pushes_to_another_host_over_grpc(servers, monkeypatch):
    """A client whose plane listens on loopback (no data_host) cannot be pulled from by a peer on another host:
    "auto" pushes over gRPC (simulated: the peer's address taken as remote)."""
    server = servers(BlockPool(SPEC))
    monkeypatch.setattr("mooncake_jax.transfer.messenger.host_of", lambda address: "10.0.0.2")
    with MessengerClient(server.address, filled_pool(KEYS), timeout_s=SHORT_S) as client:
        assert client.plane(pushing=True) == "grpc"
        assert client.push(KEYS).moved == KEYS
        assert client.counters.socket_bytes == 0 and client.counters.plane_fallbacks == 1
    assert_exact(server.pool, KEYS)


def test_one_plane_per_listening_host():
    assert socket_plane() is socket_plane("127.0.0.1") is socket_plane(None, None)
    assert socket_plane("127.0.0.2") is not socket_plane()
    assert socket_plane("127.0.0.2", "10.0.0.1") is not socket_plane("127.0.0.2")
    assert socket_plane("127.0.0.2", "10.0.0.1").address.startswith("10.0.0.1:")
    assert device_plane() is device_plane("127.0.0.1") and device_plane("127.0.0.2") is not device_plane()
    assert device_plane("127.0.0.2").host == "127.0.0.2"  # nothing started: importing JAX is not needed here


def test_the_instance_wires_its_host_and_advertised_host_into_its_clients():
    config = InstanceConfig("prefill", conductor_address="127.0.0.1:1", host="0.0.0.0", advertise="10.1.2.3:7000")
    assert config.data_plane == "auto" and config.advertised_host == "10.1.2.3"
    with BlockPool(SPEC, dram_blocks=2) as pool:
        stand_in = SimpleNamespace(_clients_lock=threading.Lock(), _clients={}, pool=pool, config=config)
        client = InstanceServer.messenger(stand_in, "127.0.0.1:9")
        assert (client.data_plane, client.data_host, client.data_advertise) == ("auto", "0.0.0.0", "10.1.2.3")
        client.close()
        stand_in.config = config.replace(advertise="")
        stand_in._clients.clear()
        client = InstanceServer.messenger(stand_in, "127.0.0.1:9")
        assert (client.data_host, client.data_advertise) == ("0.0.0.0", None)  # the puller resolves the wildcard
        client.close()


def test_data_plane_values_are_named_everywhere(capsys):
    with pytest.raises(ValueError, match=r"data_plane must be one of \['auto', 'grpc', 'jax', 'socket'\], got 'tcp'"):
        InstanceConfig("decode", data_plane="tcp")
    with pytest.raises(ValueError, match="data_plane must be one of auto, grpc, jax, socket, got 'tcp'"):
        MessengerClient("127.0.0.1:1", BlockPool(SPEC), data_plane="tcp")
    base = ["--role", "decode", "--conductor", "127.0.0.1:1"]
    assert parse_args(base).data_plane == "auto"
    assert parse_args([*base, "--data-plane", "grpc"]).data_plane == "grpc"
    c = InstanceConfig("decode", data_plane="socket")
    assert InstanceConfig.from_json(c.to_json()).data_plane == "socket"
    with pytest.raises(SystemExit):
        parse_args([*base, "--data-plane", "rdma"])
    assert "invalid choice: 'rdma'" in capsys.readouterr().err
    from mooncake_jax.cli import build_parser

    for command in ("serve", "demo"):
        args = build_parser(command).parse_args([command, "--data-plane", "socket"])
        assert args.data_plane == "socket"
    from mooncake_jax.instance.cluster_spec import role_configs

    assert {c.data_plane for c in role_configs("tiny", 1, 1, options={"data_plane": "grpc"})} == {"grpc"}
    assert {c.data_plane for c in role_configs("tiny", 1, 1)} == {"auto"}


def test_the_peer_says_which_planes_it_serves(servers):
    plain = servers(BlockPool(SPEC))
    grpc_only = servers(BlockPool(SPEC), serve_socket=False)
    for server, planes in ((plain, ["grpc", "jax", "socket"]), (grpc_only, ["grpc", "jax"])):
        with grpc.insecure_channel(server.address) as channel:
            reply = services.MessengerStub(channel).Has(messages.HasRequest(keys=[], spec_fingerprint=SPEC.fingerprint),
                                                        timeout=10)
        assert list(reply.data_planes) == planes
    with grpc.insecure_channel(grpc_only.address) as channel:  # asked for it anyway: refused by name
        with pytest.raises(grpc.RpcError) as caught:
            services.MessengerStub(channel).OfferPull(messages.FetchRequest(
                keys=[1], spec_fingerprint=SPEC.fingerprint, data_plane="socket"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert 'configured data_plane="grpc"' in caught.value.details()


def test_a_cluster_on_another_loopback_host_moves_its_kv_on_the_socket_plane():
    """End to end with the defaults: instances listening on 127.0.0.2 push KV prefill -> decode on the socket
    plane, from listeners on 127.0.0.2, and the tokens equal the single engine's."""
    import mooncake_jax as mj
    from reference_model import random_prompts
    from test_cluster import FAST, PROFILE

    prompts = random_prompts([40, 70], seed=16)
    with mj.Cluster.local("tiny", prefill=1, decode=1, profile_json=PROFILE, host="127.0.0.2", **FAST) as cluster:
        assert {c.data_plane for c in cluster.configs} == {"auto"}
        tokens = cluster.generate(prompts, max_new_tokens=4)
        decode = cluster.instances["decode-0"]
        prefill = cluster.instances["prefill-0"]
        assert decode.address.startswith("127.0.0.2:")
        stats = decode.stats()
        pushed = prefill.messenger(decode.address).counters.socket_bytes  # the prefill side's client
    assert tokens == mj.LLM("tiny").generate(prompts, max_new_tokens=4)
    assert stats["messenger_socket_bytes"] > 0 and stats["messenger_socket_bytes"] == stats["messenger_bytes_received"]
    assert pushed == stats["messenger_socket_bytes"]
    assert socket_plane("127.0.0.2")._listener.getsockname()[0] == "127.0.0.2"
