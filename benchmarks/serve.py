"""Load test of ``mooncake-jax serve`` with the tiny model, and the same load on one coupled engine.

``--clients`` concurrent clients (default 64) send streaming OpenAI completions for ``--duration`` seconds
(default 60), each prompt a scaled request of the bundled conversation trace (its shared prefixes are real shared
prefixes). Counted per run: requests completed, rejected (HTTP 429), failed (any other status or an error event)
and lost (no answer at all: must be 0); TTFT and TBT percentiles as the client sees them; peak memory (VmHWM) of
every process; requests/s and output tokens/s. Two runs on the same CPUs: 2 prefill + 1 decode instances
(disaggregated) and ``serve --coupled`` (one engine doing both).

    python benchmarks/serve.py --json results/serve.json

``--mode idle`` measures the gateway's front end under idle connections: ``--idle`` keep-alive connections
(default 200) are opened and held (each asks ``GET /v1/models`` when opened and every ``--idle-ping`` seconds, as
a client's connection pool keeps its connections warm) while ``--clients`` streaming clients (default 16) run
for ``--duration`` seconds (default 20) against ``serve`` (2 prefill + 1 decode, or ``--coupled``). The gateway
process's thread count and RSS are sampled throughout. Flat keys: ``idle_connections_held`` (answering at the
end), ``requests_per_s``, ``ttft_p90_s``, ``tbt_p90_s``, ``gateway_threads_max``, ``gateway_rss_mib_max``,
``failed``, ``lost``. The issue's full size:

    python benchmarks/serve.py --mode idle --idle 1000 --clients 64 --duration 60 --json results/serve_idle.json

``--mode overload`` drives ``serve`` (2 prefill + 1 decode) past what it can serve within a small TTFT SLO
(``--ttft-slo`` seconds, default 2, given to serve's ``--ttft-slo-s``): ``--clients`` streaming clients (default
96) each ask ``--max-tokens`` tokens (default 512) of a trace prompt, back to back, for ``--duration`` seconds
(default 60); a client answered 429 waits its Retry-After before its next request, as a well-behaved client does.
Flat keys: ``overload_rejected`` (fraction of requests answered 429), ``reject_s_p50`` / ``reject_s_p99`` (time
to the 429), ``retry_after_missing`` (429s without the header), ``admitted_ttft_p50_s`` / ``admitted_ttft_p99_s``
and ``admitted_within_slo`` (TTFT of the requests that got a first token), ``ttft_slo_s``, ``rejected_early`` /
``rejected_late`` (the cluster's counters: before prefill, or by the decode instance after it), ``failed``,
``lost``, ``cpu_model``, ``load_average``.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import DONE, arg_parser, machine_info, sse_payloads, start_serve, write_json  # noqa: E402


def peak_memory_mb(pid: int) -> dict[str, float]:
    """VmHWM of ``pid`` and its children, in MiB."""
    out = {}
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    for p in [pid] + [int(x) for x in children.split()]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM"))
        name = ("serve" if p == pid else cmd.split("--instance-id ")[-1].split()[0] if "--instance-id " in cmd
                else "conductor")
        out[name] = round(kib / 1024, 1)
    return out


def load_test(http_port: int, prompts: list[dict], clients: int, duration_s: float) -> dict:
    from mooncake_jax.demo import send

    url = f"http://127.0.0.1:{http_port}/v1/completions"
    results, lock = [], threading.Lock()
    deadline = time.perf_counter() + duration_s
    sent = [0]

    def client(c: int) -> None:
        i = c
        while time.perf_counter() < deadline:
            with lock:
                sent[0] += 1
            try:
                r = send(url, prompts[i % len(prompts)], timeout_s=120)
            except Exception as e:  # anything that escapes is a lost request
                r = {"status": "lost", "error": repr(e)}
            with lock:
                results.append(r)
            i += clients

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    done = [r for r in results if r["status"] == "completed" and r["times"]]
    ttft = np.array([r["times"][0] for r in done])
    from mooncake_jax.slo import tbt_of_times

    tbt = np.array([tbt_of_times(r["times"]) for r in done if len(r["times"]) > 1])

    def pct(a, q):
        return round(float(np.percentile(a, q)), 4) if a.size else None

    return {"sent": sent[0], "completed": len(done),
            "rejected": sum(r["status"] == "rejected" for r in results),
            "failed": sum(r["status"] == "failed" for r in results),
            "lost": sent[0] - len(results) + sum(r["status"] == "lost" for r in results),
            "requests_per_s": round(len(done) / wall, 2),
            "output_tokens_per_s": round(sum(len(r["times"]) for r in done) / wall, 1),
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "tbt_p50_s": pct(tbt, 50), "tbt_p90_s": pct(tbt, 90), "tbt_p99_s": pct(tbt, 99), "wall_s": round(wall, 1),
            "errors": sorted({str(r.get("error") or r.get("code")) for r in results
                              if r["status"] in ("failed", "lost")})[:5]}


class IdleConnections:
    """``count`` kept-alive HTTP connections to the gateway, each used for one small request at opening and
    every ``ping_s`` seconds (a thread of its own walks them in turn); counts those that stop answering."""

    _REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: bench\r\n\r\n"

    def __init__(self, port: int, count: int, ping_s: float):
        self.port, self.ping_s = port, ping_s
        self.socks: list[socket.socket | None] = []
        self.failures = 0
        for _ in range(count):
            self.socks.append(self._open())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, daemon=True)
        self._thread.start()

    def _open(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=30)
            return sock if self._ask(sock) else None
        except OSError:
            self.failures += 1
            return None

    def _ask(self, sock: socket.socket) -> bool:
        """One request on ``sock``; False (and the socket closed) if it did not get a 200 answer."""
        try:
            sock.sendall(self._REQUEST)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = sock.recv(65536)
                if not chunk:
                    raise OSError("closed")
                data += chunk
            head, body = data.split(b"\r\n\r\n", 1)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(body) < length:
                chunk = sock.recv(65536)
                if not chunk:
                    raise OSError("closed")
                body += chunk
            if not head.startswith(b"HTTP/1.1 200"):
                raise OSError(head.split(b"\r\n")[0].decode())
            return True
        except (OSError, StopIteration, ValueError):
            self.failures += 1
            sock.close()
            return False

    def _keep(self) -> None:
        while not self._stop.wait(self.ping_s):
            self.ping()

    def ping(self) -> int:
        """Use every live connection once; the number that answered."""
        for i, sock in enumerate(self.socks):
            if sock is not None and not self._ask(sock):
                self.socks[i] = None
        return sum(sock is not None for sock in self.socks)

    def close(self) -> int:
        self._stop.set()
        self._thread.join()
        held = self.ping()
        for sock in self.socks:
            if sock is not None:
                sock.close()
        return held


class ProcessSampler:
    """Thread count and RSS of one process, sampled every ``every_s`` seconds; the maxima."""

    def __init__(self, pid: int, every_s: float = 0.5):
        self.pid, self.threads_max, self.rss_mib_max = pid, 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while True:
            try:
                status = Path(f"/proc/{self.pid}/status").read_text().splitlines()
                fields = {line.split(":")[0]: line.split()[1] for line in status if ":" in line and line.split()[1:]}
                self.threads_max = max(self.threads_max, int(fields["Threads"]))
                self.rss_mib_max = max(self.rss_mib_max, int(fields["VmRSS"]) / 1024)
            except (OSError, KeyError, ValueError):
                pass
            if self._stop.wait(every_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def idle_mode(args, prompts: list[dict], res: dict) -> None:
    idle = 200 if args.idle is None else args.idle
    extra = ["--coupled"] if args.coupled else ["--prefill", "2", "--decode", "1"]
    print(f"idle mode ({' '.join(extra)}): starting", flush=True)
    proc, port = start_serve(extra)
    try:
        sampler = ProcessSampler(proc.pid)
        baseline = dict(threads=0, rss=0.0)
        time.sleep(1.0)
        baseline.update(threads=sampler.threads_max, rss=sampler.rss_mib_max)
        holder = IdleConnections(port, idle, args.idle_ping)
        print(f"holding {sum(s is not None for s in holder.socks)} idle connections; {args.clients} clients for "
              f"{args.duration:.0f} s", flush=True)
        figures = load_test(port, prompts, args.clients, args.duration)
        held = holder.close()
        sampler.stop()
    finally:
        proc.terminate()
        proc.wait(60)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    res.update(cpu_model=cpu, server="disaggregated_2p1d" if not args.coupled else "coupled",
               idle_connections_asked=idle,
               idle_connections_held=held, idle_connection_failures=holder.failures,
               gateway_threads_before_load=baseline["threads"], gateway_rss_mib_before_load=round(baseline["rss"], 1),
               gateway_threads_max=sampler.threads_max, gateway_rss_mib_max=round(sampler.rss_mib_max, 1),
               **figures)
    print(res, flush=True)


def overload_request(port: int, item: dict, max_tokens: int, timeout_s: float) -> dict:
    """One streaming completion: its status, when the answer's head came (the 429's time), its Retry-After, and
    when its first token came."""
    body = json.dumps({"model": "tiny", "prompt": item["prompt"], "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        head_s = time.perf_counter() - t0
        if resp.status != 200:
            text = resp.read().decode(errors="replace")
            return {"status": "rejected" if resp.status == 429 else "failed", "code": resp.status,
                    "answer_s": head_s, "retry_after": resp.getheader("Retry-After"),
                    "late": "overloaded (" not in text}  # the Conductor's refusals say "overloaded (reason)"
        first_s, done = None, False
        for chunk in sse_payloads(resp):
            if chunk == DONE:
                done = True
            elif "error" in chunk:  # ended with a status after it was admitted
                return {"status": "failed", "code": chunk["error"].get("code"), "first_s": first_s}
            elif first_s is None and chunk.get("choices"):
                first_s = time.perf_counter() - t0
        return {"status": "completed" if done else "lost", "first_s": first_s}
    except TimeoutError:
        return {"status": "lost", "error": "no answer in time"}
    except (OSError, http.client.HTTPException, ValueError) as e:
        return {"status": "lost", "error": repr(e)}
    finally:
        conn.close()


def overload_mode(args, prompts: list[dict], res: dict) -> None:
    slo = args.ttft_slo
    extra = ["--prefill", "2", "--decode", "1", "--ttft-slo-s", str(slo)]
    print(f"overload mode ({' '.join(extra)}): starting", flush=True)
    proc, port = start_serve(extra)
    results, lock = [], threading.Lock()
    try:
        deadline = time.perf_counter() + args.duration

        def client(c: int) -> None:
            i = c
            while time.perf_counter() < deadline:
                r = overload_request(port, prompts[i % len(prompts)], args.max_tokens, timeout_s=120)
                with lock:
                    results.append(r)
                i += args.clients
                if r["status"] == "rejected":
                    try:
                        time.sleep(min(float(r["retry_after"]), max(0.0, deadline - time.perf_counter())))
                    except (TypeError, ValueError):
                        time.sleep(1.0)

        print(f"{args.clients} clients asking {args.max_tokens} tokens for {args.duration:.0f} s", flush=True)
        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = {}
        counters = ("mooncake_backend_cluster_",)
        try:  # the cluster's own counters of where it rejected
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", "/metrics")
            for line in conn.getresponse().read().decode().splitlines():
                if line.startswith(counters):
                    name, value = line.split()[:2]
                    stats[name] = float(value)
            conn.close()
        except OSError:
            pass
    finally:
        proc.terminate()
        proc.wait(60)
    rejected = [r for r in results if r["status"] == "rejected"]
    admitted = np.array([r["first_s"] for r in results if r.get("first_s") is not None])
    answers = np.array([r["answer_s"] for r in rejected])

    def pct(a, q):
        return round(float(np.percentile(a, q)), 4) if a.size else None

    res.update(
        mode="overload", server="disaggregated_2p1d", ttft_slo_s=slo, max_tokens=args.max_tokens,
        requests=len(results), completed=sum(r["status"] == "completed" for r in results),
        overload_rejected=round(len(rejected) / max(1, len(results)), 4), rejected=len(rejected),
        reject_s_p50=pct(answers, 50), reject_s_p99=pct(answers, 99), reject_s_max=pct(answers, 100),
        reject_early_s_p99=pct(np.array([r["answer_s"] for r in rejected if not r["late"]]), 99),
        reject_late_s_p99=pct(np.array([r["answer_s"] for r in rejected if r["late"]]), 99),
        retry_after_missing=sum(r["retry_after"] is None for r in rejected),
        admitted=int(admitted.size), admitted_ttft_p50_s=pct(admitted, 50), admitted_ttft_p99_s=pct(admitted, 99),
        admitted_ttft_max_s=pct(admitted, 100),
        admitted_within_slo=round(float(np.mean(admitted <= slo)), 4) if admitted.size else None,
        rejected_early=int(stats.get("mooncake_backend_cluster_rejected_early_total", -1)),
        rejected_late=int(stats.get("mooncake_backend_cluster_rejected_late_total", -1)),
        failed=sum(r["status"] == "failed" for r in results), lost=sum(r["status"] == "lost" for r in results),
        failed_codes=sorted({str(r.get("code")) for r in results if r["status"] == "failed"}),
        lost_errors=sorted({r.get("error", "") for r in results if r["status"] == "lost"})[:5],
        load_average=list(os.getloadavg()), **ttft_parts(stats))


def ttft_parts(stats: dict) -> dict:
    """Mean TTFT of the admitted requests as the cluster's router saw it, beside the Conductor's prediction, and
    its parts: prefill queue and compute (the prefill instance's own clock), the rest of the prefill call (pool
    I/O, KV push, RPC), and the wait for the decode instance's acceptance."""
    def total(name):
        return stats.get(f"mooncake_backend_cluster_{name}_total", 0.0)

    n = total("first_tokens")
    if not n:
        return {}
    mean = {k: total(k) / n for k in ("ttft_predicted_seconds", "ttft_seconds", "ttft_prefill_reply_seconds",
                                      "ttft_prefill_queue_seconds", "ttft_prefill_seconds")}
    return {"router_first_tokens": int(n), "predicted_ttft_mean_s": round(mean["ttft_predicted_seconds"], 4),
            "router_ttft_mean_s": round(mean["ttft_seconds"], 4),
            "prefill_queue_mean_s": round(mean["ttft_prefill_queue_seconds"], 4),
            "prefill_compute_mean_s": round(mean["ttft_prefill_seconds"], 4),
            "prefill_call_other_mean_s": round(mean["ttft_prefill_reply_seconds"] - mean["ttft_prefill_queue_seconds"]
                                               - mean["ttft_prefill_seconds"], 4),
            "decode_accept_mean_s": round(mean["ttft_seconds"] - mean["ttft_prefill_reply_seconds"], 4)}


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--mode", choices=["compare", "idle", "overload"], default="compare",
                   help="compare: disaggregated vs coupled; idle: the gateway under idle connections; overload: "
                        "429s and admitted TTFT past capacity")
    p.add_argument("--clients", type=int, default=None,
                   help="streaming clients (compare: 64, idle: 16, overload: 96)")
    p.add_argument("--duration", type=float, default=None, help="seconds of load (compare: 60, idle: 20)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="overload mode: serve's TTFT SLO (s)")
    p.add_argument("--max-tokens", type=int, default=512, help="overload mode: tokens each request asks")
    p.add_argument("--requests", type=int, default=400, help="distinct trace requests to cycle through")
    p.add_argument("--idle", type=int, default=None, help="idle mode: keep-alive connections held (200)")
    p.add_argument("--idle-ping", type=float, default=20.0, help="idle mode: seconds between uses of each one")
    p.add_argument("--coupled", action="store_true", help="idle mode: serve --coupled instead of 2p1d")
    args = p.parse_args()
    idle_mode_on = args.mode == "idle"
    args.clients = args.clients or {"idle": 16, "overload": 96}.get(args.mode, 64)
    args.duration = args.duration or (20.0 if idle_mode_on else 60.0)

    from mooncake_jax.demo import workload
    from mooncake_jax.model.config import PRESETS

    cfg = PRESETS["tiny"]
    # overload mode asks --max-tokens of every prompt: leave them room in the context window
    room = args.max_tokens if args.mode == "overload" else 0
    prompts = workload(args.requests, cfg.vocab_size, cfg.max_seq_len - room)
    res = dict(machine_info(), clients=args.clients, duration_s=args.duration,
               mean_prompt_tokens=round(float(np.mean([len(x["prompt"]) for x in prompts])), 1),
               mean_max_tokens=round(float(np.mean([x["max_tokens"] for x in prompts])), 1))
    if idle_mode_on:
        idle_mode(args, prompts, res)
        write_json(res, args.json)
        return
    if args.mode == "overload":
        overload_mode(args, prompts, res)
        write_json(res, args.json)
        return
    for name, extra in (("disaggregated_2p1d", ["--prefill", "2", "--decode", "1"]), ("coupled", ["--coupled"])):
        print(f"{name}: starting", flush=True)
        proc, port = start_serve(extra)
        try:
            print(f"{name}: {args.clients} clients for {args.duration:.0f} s", flush=True)
            figures = load_test(port, prompts, args.clients, args.duration)
            figures["peak_memory_mb"] = peak_memory_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait(60)
        res[name] = figures
        print(name, figures, flush=True)
    res["disaggregated_over_coupled_requests_per_s"] = round(
        res["disaggregated_2p1d"]["requests_per_s"] / max(res["coupled"]["requests_per_s"], 1e-9), 3)
    write_json(res, args.json)


if __name__ == "__main__":
    main()
