"""The paper's service-level measures, defined once for the engine, the gateway, the demo and the simulator.

TBT (time between tokens) of a request is the mean of the longest 10% of its token gaps (at least one gap), so a
request that stalls now and then is judged by its stalls, not averaged away. TTFT is arrival to first token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def tbt_of_gaps(gaps: Sequence[float]) -> float:
    """Mean of the longest ceil(10%) of ``gaps``; NaN when there is no gap."""
    n = len(gaps)
    if n == 0:
        return math.nan
    k = max(1, math.ceil(0.1 * n))
    return float(np.partition(np.asarray(gaps, float), n - k)[n - k:].mean())


def tbt_of_times(token_times: Sequence[float]) -> float:
    """TBT of a request whose tokens appeared at ``token_times`` (0.0 with fewer than two tokens)."""
    if len(token_times) < 2:
        return 0.0
    return tbt_of_gaps(np.diff(np.asarray(token_times, float)))
