"""A load client for the multi-host test: ``python load_client.py HOST:PORT SECONDS CONCURRENCY TIMEOUT_S TOKEN``;
``python load_client.py --list CONDUCTOR TOKEN`` prints what the Conductor lists (ids, indexed blocks, model).

Sends completions (token-id prompts) to a gateway's HTTP API from CONCURRENCY threads for SECONDS, and prints one
JSON line: requests completed, failed (an HTTP error status, with the statuses seen), hung (no answer within
TIMEOUT_S), and the completion times (seconds since start) so a caller can tell what happened around an event.
It runs as its own process so that it can sit in a network namespace of its own.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request


PROMPTS = [[1 + k, *range(2, 18), 18 + k % 2] for k in range(6)]
"""A few prompts, cycled: a warm-up run over them compiles every step shape the measured run uses (first sight and
prefix hit), so what is measured is serving, not compiling."""


def listing(conductor: str, token: str) -> dict:
    from mooncake_jax.conductor.service import messages, services
    from mooncake_jax.proto.auth import open_channel

    with open_channel(conductor, token) as channel:
        reply = services.ConductorStub(channel).ListInstances(messages.ListInstancesRequest(), timeout=10)
    return {"instances": sorted(i.instance_id for i in reply.instances), "indexed_blocks": reply.indexed_blocks,
            "model": reply.model, "blocks": {i.instance_id: i.blocks for i in reply.instances}}


def run(address: str, seconds: float, concurrency: int, timeout_s: float = 60.0, token: str = "") -> dict:
    t0 = time.monotonic()
    lock = threading.Lock()
    counts = {"completed": 0, "failed": 0, "hung": 0, "statuses": {}, "completed_at": [], "failed_at": []}

    def worker(n: int) -> None:
        i = 0
        while time.monotonic() - t0 < seconds:
            prompt = PROMPTS[(n + i) % len(PROMPTS)]
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}).encode()
            request = urllib.request.Request(f"http://{address}/v1/completions", body,
                                             {"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
            i += 1
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as answer:
                    ok = answer.status == 200 and json.loads(answer.read())["choices"]
                    outcome, status = ("completed" if ok else "failed"), answer.status
            except urllib.error.HTTPError as e:
                outcome, status = "failed", e.code
            except TimeoutError:
                outcome, status = "hung", "timeout"
            except (urllib.error.URLError, ConnectionError) as e:
                hung = isinstance(getattr(e, "reason", None), TimeoutError)
                outcome, status = ("hung", "timeout") if hung else ("failed", type(e).__name__)
            if outcome == "failed":
                time.sleep(0.25)  # as a client honouring Retry-After would, instead of spinning on a 503
            with lock:
                counts[outcome] += 1
                counts["statuses"][str(status)] = counts["statuses"].get(str(status), 0) + 1
                if outcome != "hung":
                    counts[f"{outcome}_at"].append(round(time.monotonic() - t0, 2))

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


if __name__ == "__main__":
    if sys.argv[1] == "--list":
        print(json.dumps(listing(sys.argv[2], sys.argv[3])), flush=True)
    else:
        address, seconds, concurrency, timeout_s, token = sys.argv[1:6]
        print(json.dumps(run(address, float(seconds), int(concurrency), float(timeout_s), token)), flush=True)
