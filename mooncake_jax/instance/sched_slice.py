"""A short CPU time slice for the threads that carry tokens (decode instances, the gateway), where Linux has one.

Why: on cores shared with prefill processes, each hop of a token (the decode engine thread handing it to a gRPC
thread, the gateway reading the stream, its event loop writing the chunk) wakes a thread that must wait for a core.
Linux's EEVDF scheduler (6.6 and later) lets the running thread finish its slice before a woken one of equal or
lower deadline preempts it: 1.4 ms by default on 2 cores, longer than a small model's decode step. A thread that
asks for a short slice (``sched_setattr`` with ``sched_runtime``, honoured for SCHED_OTHER since Linux 6.12) gets
an earlier deadline and preempts at wake-up. It does not raise its share of the CPU (that is the niceness); it only
runs sooner, for less at a time. Elsewhere (another OS or architecture, an older kernel) nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

log = logging.getLogger(__name__)

SHORT_SLICE_NS = 100_000
"""The slice asked for: 0.1 ms, the shortest Linux grants (it clamps to 0.1-100 ms)."""
_RESET_ON_FORK = 0x01
"""``SCHED_FLAG_RESET_ON_FORK``."""
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
"""``sched_setattr`` / ``sched_getattr`` numbers by machine."""


class _SchedAttr(ctypes.Structure):
    """``struct sched_attr`` (include/uapi/linux/sched/types.h), up to the utilization clamps."""

    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64),
                ("nice", ctypes.c_int32), ("priority", ctypes.c_uint32), ("runtime", ctypes.c_uint64),
                ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64), ("util_min", ctypes.c_uint32),
                ("util_max", ctypes.c_uint32)]


def _syscalls() -> tuple[int, int] | None:
    """This process's ``sched_setattr`` / ``sched_getattr`` numbers; None off Linux, or for a 32-bit interpreter
    (``platform.machine`` names the kernel's architecture, whose numbers a 32-bit process does not share)."""
    if os.name != "posix" or platform.system() != "Linux" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    return _SYSCALLS.get(platform.machine())


def threads_of(pid: int) -> list[int]:
    """Thread ids of process ``pid`` (Linux lists them in /proc; elsewhere only the process's own id)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _call(number: int, *args) -> None:
    """``syscall(number, *args)``; OSError (its errno's subclass) when it fails."""
    if _libc().syscall(number, *args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _attributes(tid: int) -> tuple[_SchedAttr, int]:
    """Thread ``tid``'s scheduling attributes (0: the calling thread's) and the ``sched_setattr`` number to write
    them back with; OSError where they cannot be read."""
    numbers = _syscalls()
    if numbers is None:
        raise OSError(f"no sched_setattr on {platform.system()} {platform.machine()}")
    attr = _SchedAttr()
    _call(numbers[1], tid, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    return attr, numbers[0]


def slice_ns(tid: int = 0) -> int | None:
    """The slice thread ``tid`` (0: the calling one) runs with, in ns; None where it cannot be read."""
    try:
        return int(_attributes(tid)[0].runtime)
    except OSError:
        return None


def set_slice(tid: int, ns: int) -> None:
    """Ask for a slice of ``ns`` for thread ``tid`` (0: the calling one; 0 ns: the default), keeping its policy and
    niceness. OSError where refused or unsupported."""
    attr, setattr_number = _attributes(tid)
    if attr.policy not in (os.SCHED_OTHER, getattr(os, "SCHED_BATCH", 3)):
        return  # a real-time or idle policy someone chose: leave it be
    attr.size, attr.runtime = ctypes.sizeof(attr), ns
    attr.flags &= _RESET_ON_FORK  # kept if someone set it; nothing else asked for
    _call(setattr_number, tid, ctypes.byref(attr), 0)


def prefer_short_slices(ns: int = SHORT_SLICE_NS) -> bool:
    """Every thread of this process, and those it starts from now on (they inherit it), asks for a slice of ``ns``
    (0: the default); whether that took everywhere (a log line says why not, never an error). A kernel before
    Linux 6.12 accepts the request and ignores it: read back, that is a refusal too."""
    failed = None
    for tid in threads_of(os.getpid()):
        try:
            set_slice(tid, ns)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as e:
            failed = failed or e
    if failed is None and ns and slice_ns() != ns:
        failed = "the kernel ignores sched_runtime for normal threads (Linux before 6.12)"
    if failed is not None:
        log.info("CPU slices of %s unavailable here (threads keep the default): %s",
                 f"{ns / 1e6:g} ms" if ns else "the default", failed)
        return False
    return True


def restore_default_slices() -> bool:
    """Every thread of this process back to the default slice (a process started by one that asked for short ones,
    whose work is not on a token's way: it inherited them)."""
    return prefer_short_slices(0)
