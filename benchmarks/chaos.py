"""Chaos test of ``mooncake-jax serve`` (tiny model, 2 prefill + 1 decode instance processes): a bounded load of
streaming clients runs for a few minutes while a random prefill instance, the decode instance and then the
Conductor (serve runs it as its own supervised process, restarted on the same address) are SIGKILLed in turn;
``--serve-kill`` then also kills the serve process itself (the gateway: its recovery is a restart of serve, as an
orchestrator would do).

Every request ends in one of: completed (``[DONE]`` after its finish chunk), failed with a status (HTTP status,
an SSE error event, or a refused connection while nothing listens), hung (no byte for ``--hang-s`` seconds, 60 by
default) or lost (the stream ended without ``[DONE]`` and without a status: a cut connection). Recovery after a
kill: seconds from the kill until a request sent after it completes. Memory: RSS of every process (by role) after
the warm-up and at the end.

    python benchmarks/chaos.py --json results/chaos.json

Flat keys: ``completed``, ``failed``, ``hung``, ``lost``, ``recovery_s_max`` (and per kill
``recovery_s_<victim>``), ``rss_growth_max_ratio``, ``failed_by_status``, ``cpu_model``, ``load_average``.
Goals: 0 hung, 0 lost, recovery <= 30 s after each kill, memory flat within 10%.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import DONE, arg_parser, cpu_model, sse_payloads, start_serve, write_json  # noqa: E402


def start_chaos_serve(log_dir: Path, timeout_s: float = 900.0) -> tuple[subprocess.Popen, int]:
    try:
        return start_serve(["--prefill", "2", "--decode", "1", "--log-dir", str(log_dir), "--drain-grace-s", "5"],
                           timeout_s, stderr=open(log_dir / "serve.log", "a"))
    except RuntimeError as e:
        raise RuntimeError(f"{e}; see {log_dir}") from None


def children(pid: int) -> dict[str, int]:
    """instance id (or "conductor") -> pid of serve's instance and Conductor processes."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    found = {}
    for p in (int(x) for x in out.split()):
        try:
            args = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--instance-id" in args:
            found[args[args.index(b"--instance-id") + 1].decode()] = p
        elif b"conductor" in args[:4]:  # python -m mooncake_jax.cli conductor ...
            found["conductor"] = p
    return found


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def memory(serve_pid: int) -> dict[str, float]:
    return {"serve": rss_mib(serve_pid)} | {name: rss_mib(pid) for name, pid in children(serve_pid).items()}


class Load:
    """``clients`` threads sending streaming completions to ``self.port`` until stopped."""

    def __init__(self, clients: int, hang_s: float, seed: int):
        self.port = 0
        self.hang_s = hang_s
        self.results: list[tuple[float, float, str]] = []  # (sent, ended, outcome)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(seed + i,), daemon=True) for i in range(clients)]

    def start(self):
        for t in self.threads:
            t.start()

    def join(self):
        self.stop.set()
        for t in self.threads:
            t.join(self.hang_s + 30)

    def _client(self, seed: int):
        rng = random.Random(seed)
        shared = [rng.randrange(3, 500) for _ in range(32)]
        while not self.stop.is_set():
            prompt = shared[:rng.choice([0, 16, 32])] + [rng.randrange(3, 500) for _ in range(rng.randrange(8, 48))]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": rng.randrange(8, 64), "stream": True,
                    "ignore_eos": True}
            sent = time.monotonic()
            outcome = self._one(body)
            with self.lock:
                self.results.append((sent, time.monotonic(), outcome))
            if not outcome.startswith("completed"):
                time.sleep(0.2)  # a failing client backs off a little, as a real one would

    def _one(self, body) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.hang_s)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                resp.read()
                return f"failed:{resp.status}"
            last, done = None, False
            for payload in sse_payloads(resp):
                if payload == DONE:
                    done = True
                else:
                    last = payload
            if last is not None and "error" in last:
                return f"failed:{last['error'].get('code')}-in-stream"
            return "completed" if done else "lost"
        except TimeoutError:
            return "hung"
        except ConnectionRefusedError:
            return "failed:connection-refused"
        except (ConnectionError, http.client.HTTPException, OSError) as e:
            return f"lost:{type(e).__name__}"
        finally:
            conn.close()


def main() -> None:
    p = arg_parser(__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--phase-s", type=float, default=40.0, help="load before the first kill and after each kill")
    p.add_argument("--hang-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-kill", action="store_true",
                   help="after the Conductor, also kill the serve process (gateway) and start it again")
    args = p.parse_args()
    rng = random.Random(args.seed)
    log_dir = Path(tempfile.mkdtemp(prefix="mooncake-chaos-"))
    proc, port = start_chaos_serve(log_dir)
    load = Load(args.clients, args.hang_s, args.seed)
    load.port = port
    load.start()
    kills: list[tuple[str, float]] = []
    try:
        time.sleep(args.phase_s)
        rss_start = memory(proc.pid)
        victims = [rng.choice(["prefill-0", "prefill-1"]), "decode-0", "conductor"]
        victims += ["serve"] if args.serve_kill else []
        for victim in victims:
            if victim == "serve":
                rss_end = memory(proc.pid)  # before the restart: the same processes as at the start
                kills.append((victim, time.monotonic()))
                proc.kill()
                proc.wait()
                time.sleep(1.0)  # the instances exit with it (their stdin closes)
                proc, load.port = start_chaos_serve(log_dir)
            else:
                pid = children(proc.pid).get(victim)
                if pid is None:
                    raise RuntimeError(f"no process for {victim}")
                kills.append((victim, time.monotonic()))
                os.kill(pid, signal.SIGKILL)
            time.sleep(args.phase_s)
        if not args.serve_kill:
            rss_end = memory(proc.pid)
    finally:
        load.join()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    results = sorted(load.results)
    outcomes: dict[str, int] = {}
    for _, _, outcome in results:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    recovery = {}
    for victim, at in kills:
        ok = [end for sent, end, outcome in results if sent >= at and outcome == "completed"]
        recovery[f"recovery_s_{victim.split('-')[0]}"] = round(min(ok) - at, 2) if ok else float("inf")
    growth = {name: rss_end[name] / rss_start[name] for name in rss_start
              if name in rss_end and rss_start[name] > 0}
    write_json({
        "completed": outcomes.get("completed", 0),
        "failed": sum(n for k, n in outcomes.items() if k.startswith("failed")),
        "hung": outcomes.get("hung", 0),
        "lost": sum(n for k, n in outcomes.items() if k.startswith("lost")),
        "lost_in_flight_at_serve_kill": sum(1 for sent, end, outcome in results if outcome.startswith("lost")
                                            for victim, at in kills if victim == "serve" and sent <= at <= end),
        "failed_by_status": {k: n for k, n in outcomes.items() if k != "completed"},
        **recovery,
        "recovery_s_max": max(recovery.values()) if recovery else 0.0,
        "recovery_s_max_without_serve": max((v for k, v in recovery.items() if k != "recovery_s_serve"),
                                            default=0.0),
        "rss_growth_max_ratio": round(max(growth.values()), 3) if growth else float("nan"),
        "rss_mib_start": rss_start, "rss_mib_end": rss_end,
        "clients": args.clients, "phase_s": args.phase_s, "kills": [v for v, _ in kills],
        "cpu_model": cpu_model(), "load_average": list(os.getloadavg()), "logs": str(log_dir),
    }, args.json)


if __name__ == "__main__":
    main()
