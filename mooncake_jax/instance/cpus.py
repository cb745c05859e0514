"""Host CPU cores an instance runs on (``InstanceConfig.cpus``).

When prefill and decode instances share one host's cores, a decode step queued behind a prefill's matrix products
is a token gap every running request sees (TBT), and lowering the prefill processes' priority only shortens the
queue. Giving the decode instance cores of its own removes it, as the paper's deployment does with machines of its
own. An instance pins its process to its ``cpus`` before JAX starts, so XLA sizes its thread pool to them; a local
launcher keeps itself (the Conductor, the gateway) and the instances given no ``cpus`` off every core some instance
owns (``keep_off``). Linux only (``os.sched_setaffinity``); elsewhere ``cpus`` is refused with a clear error.

The cores are its compute's: once it serves, an instance moves its service threads (gRPC handlers and poller, KV
transfers, the Conductor link) to the other cores it was started with (``service_cores``, ``move_service_threads``),
and keeps only the engine thread and XLA's on ``cpus``. Why, measured with ``demo --decode-cpus 1`` on 2 cores
(``perf sched``; docs/benchmarks/demo.md, "twenty-fourth session"): with the whole process on its core, the decode
instance's engine thread spent its longest token gaps runnable behind its own gRPC threads taking in the next
request's call and KV, up to 4 ms at a time.
"""

from __future__ import annotations

import logging
import os

from .config import InstanceConfig, format_devices
from .sched_slice import threads_of

log = logging.getLogger(__name__)


def available() -> set[int]:
    """The cores this process may run on (ValueError where the platform cannot pin processes)."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("cpus: this platform cannot pin a process to cores (Linux only); leave cpus out")
    return set(range(os.cpu_count() or 1))


def check(configs: list[InstanceConfig]) -> None:
    """ValueError naming the instance and its ``cpus`` when a core does not exist, or when the cores given leave
    none for the rest (the launcher and the instances without ``cpus``)."""
    pinned = [c for c in configs if c.cpus]
    if not pinned:
        return
    cores = available()
    owned: set[int] = set()
    for c in pinned:
        missing = sorted(set(c.cpus) - cores)
        if missing:
            raise ValueError(f"{c.instance_id}: cpus {format_devices(c.cpus)} include core {missing[0]}, which does "
                             f"not exist; allowed: {format_devices(tuple(sorted(cores)))}")
        owned |= set(c.cpus)
    if not cores - owned:
        raise ValueError(f"cpus {format_devices(tuple(sorted(owned)))} take every core of this host "
                         f"({len(cores)}); leave at least one for the launcher and the instances without cpus")


def pin(cpus: tuple[int, ...] | None, pid: int = 0) -> None:
    """Run every thread of process ``pid`` (0: this one) on ``cpus``; threads it starts later inherit the mask of
    the thread that starts them. Call before JAX starts where XLA should size its thread pool to ``cpus``."""
    if not cpus:
        return
    available()
    for tid in threads_of(pid or os.getpid()):
        try:
            os.sched_setaffinity(tid, set(cpus))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
        except OSError as e:
            raise ValueError(f"cpus {format_devices(tuple(cpus))}: cannot run there ({e})") from None


COMPUTE_THREAD_PREFIXES = ("tf_", "XLA")
"""Thread names (``/proc/.../comm``) of XLA's pools, which run the engine's programs: TSL names the threads it starts
``tf_<pool>`` (XLA:CPU's intra-op pool is ``tf_XLAEigen``)."""


def service_cores(cpus: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The cores this process may run on besides ``cpus``, read before ``pin``: where its service threads go once it
    serves. None when there are none (or no ``cpus``): everything then stays on ``cpus``."""
    if not cpus or not hasattr(os, "sched_getaffinity"):
        return None
    return tuple(sorted(os.sched_getaffinity(0) - set(cpus))) or None


def move_service_threads(cores: tuple[int, ...] | None, compute: set[int]) -> int:
    """Run every thread of this process on ``cores`` but the ``compute`` ones (native thread ids: the engine loop's)
    and XLA's (``COMPUTE_THREAD_PREFIXES``). A thread started later inherits the mask of the thread starting it, so a
    gRPC handler the (moved) poller starts runs on ``cores`` too. Returns how many threads moved; for no ``cores``,
    0 and nothing done."""
    if not cores:
        return 0
    moved = 0
    for tid in threads_of(os.getpid()):
        if tid in compute:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(COMPUTE_THREAD_PREFIXES):
                    continue
            os.sched_setaffinity(tid, set(cores))
            moved += 1
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            pass
    log.info("%d service threads moved to cores %s; the engine's stay", moved, format_devices(cores))
    return moved


def keep_off(configs: list[InstanceConfig]) -> tuple[int, ...] | None:
    """Move this process (a local launcher) off every core an instance of ``configs`` owns, so that it and the
    children it starts without ``cpus`` leave those cores to their owners. Returns the cores it ran on before
    (``pin`` them to go back), None when no instance owns any."""
    owned = {core for c in configs for core in (c.cpus or ())}
    if not owned:
        return None
    before = tuple(sorted(os.sched_getaffinity(0)))
    rest = tuple(sorted(set(before) - owned)) or tuple(sorted(available() - owned))
    pin(rest)
    log.info("launcher and unpinned instances on cores %s; cores %s owned by instances", format_devices(rest),
             format_devices(tuple(sorted(owned))))
    return before
