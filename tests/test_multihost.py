"""Beyond one machine, on one machine (issue 12, point 4): the Conductor, two prefill instances, one decode instance,
the gateway and the load client run as separate processes started by the role commands, each on its own host
address: network namespaces joined by a bridge (itself in a namespace of its own, so the machine's own network is
untouched) when the test runs as root, else distinct 127.0.0.x loopback addresses. Requests flow end to end; then
the Conductor is killed (SIGKILL) mid-load and restarted on its address, and the cluster keeps serving: the
requests are counted completed / failed / hung across the restart.

The commands it runs are the ones an operator types on separate hosts (see docs/deploy.md).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mooncake_jax.conductor.profile import build_profile

TOKEN = "multihost-test-token"
SUBNET = "10.213.0"
HERE = Path(__file__).resolve().parent
PROFILE = build_profile(
    "tiny@test", "tiny", [(16, 0, 0.01), (64, 0, 0.012), (256, 0, 0.02), (256, 128, 0.015), (512, 0, 0.04)],
    [(1, 64, 0.003), (4, 256, 0.004), (16, 2048, 0.008)], kv_bytes_per_token=16384, nic_bytes_per_s=5e8,
    kv_capacity_tokens=100000)


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class Hosts:
    """One "host" per name: a network namespace with its own address on a shared bridge (as root, where ``ip
    netns`` works), else a 127.0.0.x address of this machine's loopback. ``command(name, argv)`` runs there."""

    _serial = itertools.count()

    def __init__(self, names: list[str], netns: bool = True):
        self.names = names
        self.tag = f"mj{os.getpid() % 100000}n{next(self._serial)}"
        self.namespaces: list[str] = []
        self.netns = netns and os.geteuid() == 0 and shutil.which("ip") is not None and self._make_namespaces()
        if self.netns:
            self.ip = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(names)}
        else:
            self.ip = {n: f"127.0.0.{i + 11}" for i, n in enumerate(names)}

    def _make_namespaces(self) -> bool:
        hub = f"{self.tag}hub"
        try:
            _run("ip", "netns", "add", hub)
            self.namespaces.append(hub)
            _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", hub, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                ns = f"{self.tag}{i}"
                _run("ip", "netns", "add", ns)
                self.namespaces.append(ns)
                _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"v{i}", "netns", hub)
                _run("ip", "-n", hub, "link", "set", f"v{i}", "master", "br0")
                _run("ip", "-n", hub, "link", "set", f"v{i}", "up")
                _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            return True
        except (subprocess.SubprocessError, OSError):
            self.close()
            return False

    def command(self, name: str, argv: list[str]) -> list[str]:
        if not self.netns:
            return argv
        return ["ip", "netns", "exec", f"{self.tag}{self.names.index(name)}", *argv]

    def close(self) -> None:
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.namespaces.clear()


class Role:
    """A role process: its ready line (JSON) read from stdout, its stderr kept in a log file."""

    def __init__(self, argv: list[str], log_path: Path, ready_timeout_s: float = 400, ready: bool = True):
        self.argv, self.log_path = argv, log_path
        self.log = open(log_path, "ab")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as on a host of its own: its own devices
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log, stdin=subprocess.DEVNULL, env=env)
        self.info = self._ready(ready_timeout_s) if ready else {}  # a follower process prints no ready line

    def _ready(self, timeout_s: float) -> dict:
        line: list[bytes] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0]:
            self.stop()
            raise AssertionError(f"{self.argv} did not start; its log ends:\n{self.log_path.read_text()[-3000:]}")
        return json.loads(line[0])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def exited(self, timeout_s: float) -> bool:
        try:
            self.proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.proc.stdout.close()
        self.log.close()
        return self.proc.returncode


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def conductor_listing(hosts: Hosts, address: str) -> dict:
    """What the Conductor lists, asked from the client's host (the test's own may not reach it)."""
    argv = hosts.command("client", [sys.executable, str(HERE / "load_client.py"), "--list", address, TOKEN])
    return json.loads(subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout)


@pytest.mark.slow
@pytest.mark.parametrize("netns", [True, False], ids=["netns", "loopback"])
def test_roles_on_separate_hosts_serve_and_survive_a_conductor_restart(tmp_path, netns):
    # prefill-1 is one instance of two processes (jax.distributed, gloo): process 0 on host prefill-1 serves, process
    # 1 on host prefill-1b follows it; stage=2 over the two (a ppermute between hosts), tensor=2 inside each
    hosts = Hosts(["conductor", "prefill-0", "prefill-1", "prefill-1b", "decode-0", "gateway", "client"], netns)
    if netns and not hosts.netns:
        pytest.skip("network namespaces need root and iproute2 (the loopback variant runs instead)")
    roles: dict[str, Role] = {}
    py = [sys.executable, "-m", "mooncake_jax.cli"]
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    auth = ["--auth-token-file", str(tmp_path / "token")]
    ip = hosts.ip
    conductor_address = f"{ip['conductor']}:{50051 if hosts.netns else _free_port(ip['conductor'])}"
    conductor_argv = hosts.command("conductor", [*py, "conductor", "--listen", conductor_address,
                                                 "--heartbeat-interval-s", "0.5", *auth])
    commands = {"conductor": conductor_argv}
    try:
        roles["conductor"] = Role(conductor_argv, tmp_path / "conductor.log")
        starting = {}
        # prefill-1 listens on every address of its host and registers the one the others reach it at
        listen = {name: ["--listen", f"{ip[name]}:0"] for name in ("prefill-0", "decode-0")}
        listen["prefill-1"] = ["--listen", "0.0.0.0:0", "--advertise", ip["prefill-1"]]
        listen["prefill-1b"] = ["--listen", f"{ip['prefill-1b']}:0"]  # where its collectives listen
        coordinator = f"{ip['prefill-1']}:{50061 if hosts.netns else _free_port(ip['prefill-1'])}"
        group = {"prefill-1": ["--coordinator", coordinator, "--num-processes", "2", "--process-id", "0"],
                 "prefill-1b": ["--coordinator", coordinator, "--num-processes", "2", "--process-id", "1"]}
        for name in ("prefill-0", "prefill-1", "prefill-1b", "decode-0"):
            instance_id = name.rstrip("b")
            shape = ["--pipeline-stages", "2", "--tensor-parallel", "2"] if name in group else []
            commands[name] = hosts.command(name, [
                *py, "instance", "--role", name.split("-")[0], "--instance-id", instance_id, "--conductor",
                conductor_address, *listen[name], *group.get(name, []), *shape,
                "--profile-file", str(tmp_path / "profile.json"), "--no-warmup", "--compile-cache", "none", *auth])
            starting[name] = threading.Thread(target=lambda n=name: roles.__setitem__(
                n, Role(commands[n], tmp_path / f"{n}.log", ready=n != "prefill-1b")))
            starting[name].start()
        for thread in starting.values():
            thread.join()
        assert {"prefill-0", "prefill-1", "prefill-1b", "decode-0"} <= set(roles), "an instance did not start"
        for name in ("prefill-0", "prefill-1", "decode-0"):
            assert roles[name].info["address"].startswith(ip[name] + ":")  # registered where the others reach it
        commands["gateway"] = hosts.command("gateway", [*py, "gateway", "--conductor", conductor_address,
                                                        "--host", ip["gateway"],
                                                        "--http-port", "8000" if hosts.netns else "0",
                                                        "--grpc-port", "0", *auth])
        roles["gateway"] = Role(commands["gateway"], tmp_path / "gateway.log")
        assert roles["gateway"].info["model"] == "tiny"  # learnt from the Conductor
        gateway = f"{ip['gateway']}:{roles['gateway'].info['http_port']}"
        client = hosts.command("client", [sys.executable, str(HERE / "load_client.py"), gateway])

        def load(seconds: float, concurrency: int, timeout_s: float = 60) -> subprocess.Popen:
            return subprocess.Popen([*client, str(seconds), str(concurrency), str(timeout_s), TOKEN],
                                    stdout=subprocess.PIPE, text=True)

        # the instances compile their step shapes (first sight, prefix hit, batch sizes 1-3) on first use, seconds
        # each on a loaded host (a minute or more for the first request through the two-process instance at load
        # 15): warm up, with a client timeout that covers compiling, until a run serves at full speed, so the
        # measured run measures serving
        for _ in range(10):
            warm = json.loads(load(5, 3, timeout_s=300).communicate(timeout=700)[0])
            assert warm["hung"] == 0 and warm["failed"] == 0, warm
            if warm["completed"] >= 15:
                break
        listing = conductor_listing(hosts, conductor_address)
        assert listing["instances"] == ["decode-0", "prefill-0", "prefill-1"]
        assert listing["blocks"]["prefill-1"] > 0, listing  # the multi-process instance prefilled and stored

        running, started = load(30, 3), time.monotonic()
        time.sleep(8)
        killed_at = time.monotonic()
        roles.pop("conductor").kill()  # SIGKILL mid-load
        time.sleep(2)
        roles["conductor"] = Role(conductor_argv, tmp_path / "conductor-restarted.log")
        restarted_at = time.monotonic()
        counts = json.loads(running.communicate(timeout=400)[0])
        (tmp_path / "counts.json").write_text(json.dumps(counts))
        print("multi-host", "netns" if hosts.netns else "127.0.0.x", {k: counts[k] for k in
                                                                     ("completed", "failed", "hung", "statuses")},
              f"killed at {killed_at - started:.1f} s, restarted at {restarted_at - started:.1f} s")
        assert counts["hung"] == 0, counts
        assert set(counts["statuses"]) <= {"200", "503"}, counts  # a failure is UNAVAILABLE, nothing else
        after = [t for t in counts["completed_at"] if t > restarted_at - started + 3]
        before = [t for t in counts["completed_at"] if t < killed_at - started]
        assert before and after, counts  # served before the kill and again after the restart
        deadline = time.monotonic() + 30
        while True:  # every instance registered again, and the prefill instances re-sent their blocks
            listing = conductor_listing(hosts, conductor_address)
            if len(listing["instances"]) == 3 and listing["blocks"].get("prefill-1") \
                    and listing["blocks"].get("prefill-0") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert listing["instances"] == ["decode-0", "prefill-0", "prefill-1"]
        assert listing["indexed_blocks"] > 0 and listing["model"] == "tiny"
        assert listing["blocks"]["prefill-1"] > 0, listing  # process 0 of prefill-1 re-registered its blocks
        (tmp_path / "commands.json").write_text(json.dumps(commands, indent=1))
    finally:
        codes, follower_left = {}, None
        for name in ("gateway", "prefill-0", "prefill-1", "prefill-1b", "decode-0", "conductor"):
            if name == "prefill-1b" and name in roles:  # process 0's stop releases it: it leaves by itself
                follower_left = roles[name].exited(60)
            if name in roles:
                codes[name] = roles[name].stop()
        hosts.close()
    assert all(code == 0 for code in codes.values()), codes  # each stopped cleanly on SIGTERM
    assert follower_left, "process 1 of prefill-1 did not leave when process 0 stopped"


def test_a_conductor_restart_mid_load_in_one_process_loses_no_instance_and_hangs_no_request():
    """The cheap variant (default suite): instances of this process, the Conductor stopped abruptly and served
    again on its address while three clients send requests. In-flight requests finish or fail with Unavailable,
    none hang; the instances register again and the prefill instances' blocks are back in the index, exactly."""
    import mooncake_jax as mj
    from mooncake_jax.conductor.api import PolicyConfig
    from mooncake_jax.conductor.service import serve
    from mooncake_jax.gateway.backend import Unavailable
    from reference_model import random_prompts
    from test_cluster import wait_until

    with mj.Cluster.local("tiny", prefill=1, decode=1, profile_json=json.dumps(PROFILE), heartbeat_interval_s=0.2,
                          heartbeat_timeout_s=30.0, warmup=False, compile_cache=None) as cluster:
        prompts = random_prompts([40] * 4, seed=5)
        expected = cluster.generate(prompts, max_new_tokens=3)  # compiles what the load runs (first sight ...
        assert cluster.generate(prompts, max_new_tokens=3) == expected  # ... and prefix hit)
        outcomes: list[tuple[str, float]] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def client(k: int) -> None:
            i = k
            while not stop.is_set():
                try:
                    tokens = cluster.run(prompts[i % len(prompts)], max_new_tokens=3)[0]
                    outcomes.append(("completed" if tokens == expected[i % len(prompts)] else "wrong",
                                     time.monotonic() - t0))
                except Unavailable:
                    outcomes.append(("failed", time.monotonic() - t0))
                    time.sleep(0.05)
                i += 1

        def completed_since(t: float) -> int:
            return sum(1 for k, at in list(outcomes) if k == "completed" and at > t)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        assert wait_until(lambda: completed_since(0) >= 3, 60)
        old = cluster.conductor
        host, port = old.address.rsplit(":", 1)
        old.stop(0)  # abrupt: no goodbye to anyone
        killed = time.monotonic() - t0
        time.sleep(0.5)
        cluster.conductor = serve(PolicyConfig(block_size=16), host=host, port=int(port), heartbeat_interval_s=0.2,
                                  heartbeat_timeout_s=30.0)
        restarted = time.monotonic() - t0
        assert wait_until(lambda: completed_since(restarted) >= 3, 60)
        stop.set()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a request hung"
        kinds = [k for k, _ in outcomes]
        assert "wrong" not in kinds
        assert all(killed - 0.5 < at < restarted + 5 for k, at in outcomes if k == "failed"), outcomes
        state = cluster.conductor.service.state

        def registered_again() -> bool:
            return sorted(state.instances.slot_of) == sorted(cluster.instances)

        def index_exact() -> bool:  # the index holds exactly each prefill pool's blocks
            for instance_id, instance in cluster.instances.items():
                if instance.config.role == "prefill":
                    keys = set(instance.pool.keys_by_tier().get("dram", [])) - instance.link.ignored_keys
                    slot = state.instances.slot(instance_id)
                    if not (keys and all(state.index.tier(k, slot) is not None for k in keys)
                            and state.index.blocks_of(slot) == len(keys)):
                        return False
            return True

        # the completions waited for above may be requests routed before the stop that finished after the restart,
        # so the instances' next heartbeats (every 0.2 s: NOT_FOUND, register again, whole block list) may be due yet
        assert wait_until(registered_again, 30), (sorted(state.instances.slot_of), sorted(cluster.instances))
        assert wait_until(index_exact, 30)
        print("in-process restart:", {k: kinds.count(k) for k in ("completed", "failed")})
        # a gateway started now (or restarted) knows only the Conductor's address, and serves at once
        from mooncake_jax.gateway.backend import GenerateRequest, TokenOut
        from mooncake_jax.instance.backend import ClusterBackend
        from mooncake_jax.model.config import get_config

        fresh = ClusterBackend(cluster.conductor.address, get_config("tiny"), model_name="tiny")
        try:
            items = list(fresh.generate(GenerateRequest(prompt=list(prompts[0]), max_tokens=3), None))
            assert [i.token for i in items if isinstance(i, TokenOut)] == expected[0]
        finally:
            fresh.close()
