"""How one host's cores are shared between the instances running on it (``SimConfig.host_cores``).

Each busy instance is one runnable process that can use at most one core. The scheduler hands the cores out in
proportion to each process's weight (Linux CFS: ``1024 / 1.25 ** nice``), no process getting more than it can use:
while the busy processes' weighted shares all fit, each runs at its cost model's speed; once they do not, the
heavier ones keep what they can use and the rest share what is left by weight. A local cluster runs its prefill
processes at a lower priority than its decode processes (``instance/cluster.py``: ``PREFILL_NICENESS``; where it may,
it also raises the decode processes above the rest, ``DECODE_NICENESS``, which this model does not separate from
the host's other load), so beside a busy decode process two prefills share what it leaves of the cores.
``others`` (``SimConfig.host_other_busy``): runnable processes besides the instances (the host's other load), each
weighing as a decode process and taking its share of the cores like one, measured by how a prefill slows as more of
the instances run at once (``benchmarks/sim_real/live.py`` ``contention``).

``streaming`` (``SimConfig.decode_stream_cpu_s``): the work a decode batch brings with it off its own process, the
tokens it streams (the gateway's backend receiving them, the clients' threads: one Python process beside the
instances, at most one core), in cores: it demands ``cpu seconds per token x tokens per second`` and takes no more
than that. It is why a prefill beside a decode batch of one request ran 2.7-3.1x slower than alone on two quiet
cores (eighth pass): the decode process keeps a core, the streaming process a third of the other, the two low-
priority prefills share the rest. Being proportional to the tokens streamed, it grows with the batch and shrinks
when the decode's steps slow down (``decode_rate``).

``pair_length_factor`` (``SimConfig.host_pair_length_exponent``): a prefill beside another prefill slows by more
the longer it is. On two cores a 512-token prefill ran 1.13x slower beside another than alone, one of 1,024-3,770
tokens 1.3-1.7x (twelfth pass, ``docs/benchmarks/sim.md``). (A likely cause, not separated: alone, a long
prefill's larger matrix products spread over both cores on XLA's intra-op threads, which beside another prefill
it no longer has, where a short one never used much more than one.) The shared speed (fitted at the contention
probe's 512 tokens) is divided by ``(tokens / 512) ** exponent`` for each prefill of 512 tokens or more while two
or more compute, the exponent fitted on each host.
"""

from __future__ import annotations

PAIR_REFERENCE_TOKENS = 512
"""The length at which the contention probe's pairs fit the host's weights and others: the factor is 1 there."""


def cfs_weight(niceness: int) -> float:
    """Linux CFS's weight of a process ``niceness`` levels below nice 0, relative to nice 0 (each level ~1.25x)."""
    return 1.25 ** -niceness


def shared_rates(cores: int, prefills: int, decodes: int, prefill_weight: float = 1.0,
                 others: float = 0.0, streaming: float = 0.0) -> tuple[float, float]:
    """(speed of each busy prefill process, speed of each busy decode process), as fractions of a whole core (1:
    its cost model's speed), with ``prefills`` and ``decodes`` busy on ``cores`` cores beside ``others`` runnable
    processes of the host's (any non-negative number: a mean) and a streaming process demanding ``streaming`` cores
    (0 to 1, weighing as a decode), a prefill weighing ``prefill_weight`` against a decode's or another process's
    1."""
    if not 0.0 <= streaming <= 1.0:
        raise ValueError(f"streaming must be between 0 and 1 core, got {streaming!r}")
    # count, weight, rate, the most one process of the group can use (cores)
    groups = [[prefills, prefill_weight, 1.0, 1.0], [decodes, 1.0, 1.0, 1.0], [others, 1.0, 1.0, 1.0],
              [1 if streaming > 0 else 0, 1.0, streaming, streaming]]
    left, active = float(cores), [g for g in groups if g[0] > 0]
    while active:
        total = sum(n * w for n, w, _, _ in active)
        capped = [g for g in active if left * g[1] / total >= g[3]]
        if not capped:
            for g in active:
                g[2] = left * g[1] / total
            break
        for g in capped:  # as much as it can use; the rest shared again among the others
            g[2] = g[3]
            left -= g[0] * g[3]
            active.remove(g)
    return min(1.0, groups[0][2]), min(1.0, groups[1][2])


def rates_with_streaming(cores: int, prefills: int, decodes: int, prefill_weight: float, others: float,
                         tokens_per_s: float, cpu_per_token_s: float) -> tuple[float, float, float]:
    """``shared_rates`` with the streaming load of decode batches that emit ``tokens_per_s`` tokens a second at
    full speed (their steps at the cost model's time), each token costing ``cpu_per_token_s`` of CPU off the decode
    processes: (prefill speed, decode speed, streaming cores). Slowed to speed ``r``, the batches emit ``r`` times
    as many tokens a second, so the streaming demands ``min(1, r * tokens_per_s * cpu_per_token_s)`` cores; the
    decode speed is the one at which that demand gives that speed back (the one fixed point: the demand grows with
    ``r``, the speed it leaves falls with the demand), found by bisection."""
    full = tokens_per_s * cpu_per_token_s
    if decodes == 0 or full <= 0:
        return (*shared_rates(cores, prefills, decodes, prefill_weight, others), 0.0)
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        if shared_rates(cores, prefills, decodes, prefill_weight, others, min(1.0, mid * full))[1] >= mid:
            lo = mid
        else:
            hi = mid
    streaming = min(1.0, lo * full)
    prefill, decode = shared_rates(cores, prefills, decodes, prefill_weight, others, streaming)
    return prefill, decode, streaming


def pair_length_factor(tokens: int, exponent: float) -> float:
    """How much slower than the host's shared speed a prefill computing ``tokens`` new tokens runs while another
    prefill computes too: ``(max(tokens, PAIR_REFERENCE_TOKENS) / PAIR_REFERENCE_TOKENS) ** exponent`` (1 up to the
    reference length, or with exponent 0). Shorter prefills keep the reference's slowdown: their compute (10 ms at
    256 tokens on two cores) is within the host's scheduling jitter, and their pairs read 1.2-2.1x where the longer
    ones' read 1.0-1.4x (thirteenth pass): no length dependence is read from them."""
    if not exponent:
        return 1.0
    return (max(int(tokens), PAIR_REFERENCE_TOKENS) / PAIR_REFERENCE_TOKENS) ** exponent


def paired_rate(shared: float, tokens: int, exponent: float, prefills: int) -> float:
    """The speed (fraction of a core, at most 1) of a prefill of ``tokens`` new tokens when ``prefills`` compute at
    the host's shared speed ``shared`` (``shared_rates``): divided by its ``pair_length_factor`` beside another."""
    if prefills < 2 or not exponent:
        return shared
    return min(1.0, shared / pair_length_factor(tokens, exponent))
