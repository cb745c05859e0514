"""Host CPU cores an instance runs on (``InstanceConfig.cpus``).

When prefill and decode instances share one host's cores, a decode step queued behind a prefill's matrix products
is a token gap every running request sees (TBT), and lowering the prefill processes' priority only shortens the
queue. Giving the decode instance cores of its own removes it, as the paper's deployment does with machines of its
own. An instance pins its process to its ``cpus`` before JAX starts, so XLA sizes its thread pool to them; a local
launcher keeps itself (the Conductor, the gateway) and the instances given no ``cpus`` off every core some instance
owns (``keep_off``). Linux only (``os.sched_setaffinity``); elsewhere ``cpus`` is refused with a clear error.
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
