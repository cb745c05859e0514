"""The kernel's limit on a process's memory mappings, which compiled XLA:CPU programs use up.

XLA:CPU links each kernel of a program into memory of its own: three mappings a kernel (code, constants, data),
some 100-250 for a step program of the ``tiny`` model. Linux allows a process ``vm.max_map_count`` mappings (65,530
by default). A process that holds a few hundred programs, as an in-process cluster of unlike sharded instances does
after warm-up (each instance compiles its own programs for its own devices), crosses it, and the next program's
link fails inside LLVM: the process aborts or segfaults, with no Python error (measured: the in-process
``demo --hetero`` at 61,000 mappings after ~250 programs).

``check_map_headroom`` turns that into a clear error before the limit: engines call it as they compile ahead of
traffic. Where ``/proc`` is not there (not Linux) there is no such count to read and the check does nothing.
Reading the count is not free (the kernel writes a line per mapping: ~50 ms at 20,000 measured), so the engines'
check reads it at most every ``CHECK_EVERY_S``: warm-up compiles about a program a second on a 2-core CPU, some
1,000 mappings in that time, well inside the headroom.
"""

from __future__ import annotations

import time
from pathlib import Path

MAX_MAP_COUNT = Path("/proc/sys/vm/max_map_count")
OWN_MAPS = Path("/proc/self/maps")
HEADROOM = 0.1
"""The share of the limit kept free: room for the programs compiled after warm-up and for the mappings of
everything else (thread stacks, arrays, shared libraries); 10% of the default limit is some 25-60 programs."""
CHECK_EVERY_S = 5.0
_next_check = 0.0  # monotonic time of the next reading (every engine of the process shares it)


class MapBudgetExhausted(RuntimeError):
    """This process holds nearly as many memory mappings as the kernel allows; compiling more would crash it."""


def map_limit() -> int | None:
    """``vm.max_map_count``, or None where it cannot be read."""
    try:
        return int(MAX_MAP_COUNT.read_text())
    except (OSError, ValueError):
        return None


def maps_in_use() -> int | None:
    """How many memory mappings this process holds now (lines of ``/proc/self/maps``), or None."""
    try:
        with OWN_MAPS.open("rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def check_map_headroom(limit: int | None = None, in_use: int | None = None) -> None:
    """Raise ``MapBudgetExhausted`` when this process holds more than ``1 - HEADROOM`` of the mappings the kernel
    allows it (``limit`` and ``in_use`` default to the readings of this process; without ``in_use``, read at most
    every ``CHECK_EVERY_S``)."""
    global _next_check
    if in_use is None:
        now = time.monotonic()
        if now < _next_check:
            return
        _next_check = now + CHECK_EVERY_S
    limit = map_limit() if limit is None else limit
    in_use = maps_in_use() if in_use is None else in_use
    if limit is None or in_use is None or in_use <= (1 - HEADROOM) * limit:
        return
    raise MapBudgetExhausted(
        f"this process holds {in_use:,} memory mappings of the {limit:,} the kernel allows (vm.max_map_count); "
        f"every compiled XLA:CPU program takes 100-250 more, and at the limit the process crashes. Run fewer "
        f"engines in one process (instances as processes, the default, rather than --in-process; fewer instances "
        f"or shapes), or raise the limit: sysctl -w vm.max_map_count=262144")
