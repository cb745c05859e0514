"""Load test of ``mooncake-jax serve`` with the tiny model, and the same load on one coupled engine.

``--clients`` concurrent clients (default 64) send streaming OpenAI completions for ``--duration`` seconds
(default 60), each prompt a scaled request of the bundled conversation trace (its shared prefixes are real shared
prefixes). Counted per run: requests completed, rejected (HTTP 429), failed (any other status or an error event)
and lost (no answer at all: must be 0); TTFT and TBT percentiles as the client sees them; peak memory (VmHWM) of
every process; requests/s and output tokens/s. Two runs on the same CPUs: 2 prefill + 1 decode instances
(disaggregated) and ``serve --coupled`` (one engine doing both).

    python benchmarks/serve.py --json results/serve.json
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import arg_parser, machine_info, write_json  # noqa: E402


def start(extra: list[str], timeout_s: float = 900.0) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_jax.cli", "serve", "--model", "tiny", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line: dict = {}
    reader = threading.Thread(target=lambda: line.update(text=proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not line.get("text", "").startswith("READY"):
        proc.kill()
        raise RuntimeError(f"serve did not become ready: {line}")
    ports = dict(part.split("=") for part in line["text"].split()[1:])
    return proc, int(ports["http"])


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
        name = "serve" if p == pid else cmd.split("--instance-id ")[-1].split()[0]
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


def main() -> None:
    p = arg_parser(__doc__)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--requests", type=int, default=400, help="distinct trace requests to cycle through")
    args = p.parse_args()

    from mooncake_jax.demo import workload
    from mooncake_jax.model.config import PRESETS

    cfg = PRESETS["tiny"]
    prompts = workload(args.requests, cfg.vocab_size, cfg.max_seq_len)
    res = dict(machine_info(), clients=args.clients, duration_s=args.duration,
               mean_prompt_tokens=round(float(np.mean([len(x["prompt"]) for x in prompts])), 1),
               mean_max_tokens=round(float(np.mean([x["max_tokens"] for x in prompts])), 1))
    for name, extra in (("disaggregated_2p1d", ["--prefill", "2", "--decode", "1"]), ("coupled", ["--coupled"])):
        print(f"{name}: starting", flush=True)
        proc, port = start(extra)
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
