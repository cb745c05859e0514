"""The engine's allocator settings (``model/host_memory.py``) hold for XLA:CPU's own threads: a program whose
temporaries exceed glibc's 64 MiB per-thread heaps reuses its pages from one call to the next instead of having them
mapped afresh (and faulted in) every call. Checked in a fresh process, as the setting must precede JAX's threads;
the same program in a process without the setting is the control (it must fault, or the check proves nothing)."""

import subprocess
import sys

import pytest

PROBE = r"""
import resource, sys
if sys.argv[1] == "engine":
    import mooncake_jax.model.engine  # noqa: F401  (applies the settings at import)
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
def test_large_xla_temporaries_are_reused_once_the_engine_is_imported():
    plain, engine = faults_per_call("plain"), faults_per_call("engine")
    assert plain > 10_000  # 100 MB mapped afresh: ~24,000 pages each call
    assert engine < 1_000
