"""A prefill instance's allocator settings (``model/host_memory.py``: one malloc arena, large blocks on the heap)
hold for XLA:CPU's own threads: a program whose temporaries exceed glibc's 64 MiB per-thread heaps reuses its pages
from one call to the next instead of having them mapped afresh (and faulted in) every call. Checked in a fresh
process, as the setting must precede JAX's threads; the same program in a process without the setting is the control
(it must fault, or the check proves nothing). The engine's import alone leaves each thread its own arena (a decode
process's choice), so there the program faults as in the control."""

import subprocess
import sys

import pytest

PROBE = r"""
import resource, sys
if sys.argv[1] == "prefill":
    from mooncake_jax.instance.main import tune_allocator
    tune_allocator("prefill")  # as a prefill instance does, before JAX starts its threads
import jax, jax.numpy as jnp
x = jnp.ones((5000, 64), jnp.float32)
f = jax.jit(lambda x: (jnp.exp(x @ x.T) @ x).sum())  # a 100 MB temporary between two products
for _ in range(3):
    f(x).block_until_ready()
faults = []
for _ in range(3):
    r = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r)
print(min(faults))
"""


def faults_per_call(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_large_xla_temporaries_are_reused_in_a_prefill_process_only():
    plain, prefill = faults_per_call("plain"), faults_per_call("prefill")
    assert plain > 10_000  # 100 MB mapped afresh: ~24,000 pages each call
    assert prefill < 1_000


def test_only_prefill_instances_share_one_arena(monkeypatch):
    from mooncake_jax.instance import main
    from mooncake_jax.instance.conductor_link import DECODE, PREFILL

    calls = []
    monkeypatch.setattr(main.host_memory, "share_one_arena", lambda: calls.append(1))
    main.tune_allocator(DECODE)
    assert calls == []
    main.tune_allocator(PREFILL)
    assert calls == [1]
