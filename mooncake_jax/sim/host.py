"""How one host's cores are shared between the instances running on it (``SimConfig.host_cores``).

Each busy instance is one runnable process that can use at most one core. The scheduler hands the cores out in
proportion to each process's weight (Linux CFS: ``1024 / 1.25 ** nice``), no process getting more than one core:
while the busy processes' weighted shares all fit, each runs at its cost model's speed; once they do not, the
heavier ones keep a whole core and the rest share what is left by weight. A local cluster runs its prefill processes
at a lower priority than its decode processes (``instance/cluster.py``: ``PREFILL_NICENESS``), so beside a busy
decode process two prefills share what it leaves of the cores. ``others`` (``SimConfig.host_other_busy``): runnable
processes besides the instances (the host's other load, the instances' own helper threads), each weighing as a
decode process and taking its share of the cores like one, measured by how a prefill slows as more of the
instances run at once (``benchmarks/sim_to_real.py`` ``contention``).
"""

from __future__ import annotations


def cfs_weight(niceness: int) -> float:
    """Linux CFS's weight of a process ``niceness`` levels below nice 0, relative to nice 0 (each level ~1.25x)."""
    return 1.25 ** -niceness


def shared_rates(cores: int, prefills: int, decodes: int, prefill_weight: float = 1.0,
                 others: float = 0.0) -> tuple[float, float]:
    """(speed of each busy prefill process, speed of each busy decode process), as fractions of a whole core (1:
    its cost model's speed), with ``prefills`` and ``decodes`` busy on ``cores`` cores beside ``others`` runnable
    processes of the host's (any non-negative number: a mean), a prefill weighing ``prefill_weight`` against a
    decode's or another process's 1."""
    groups = [[prefills, prefill_weight, 1.0], [decodes, 1.0, 1.0], [others, 1.0, 1.0]]  # count, weight, rate
    left, active = float(cores), [g for g in groups if g[0] > 0]
    while active:
        total = sum(n * w for n, w, _ in active)
        capped = [g for g in active if left * g[1] / total >= 1.0]
        if not capped:
            for g in active:
                g[2] = left * g[1] / total
            break
        for g in capped:  # a whole core each; the rest shared again among the others
            left -= g[0]
            active.remove(g)
    return groups[0][2], groups[1][2]
