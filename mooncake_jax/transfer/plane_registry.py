"""One data plane per listening address in a process, shared by the Messenger's servers and clients.

Why a registry and not a module global each: the socket plane and the device plane both run one listener per
process, made on first use and reused by every server and client of the process; an instance listens where it is
reached (``InstanceConfig.host``, advertised as ``advertise``), so two in-process instances on two hosts (tests,
``mj.Cluster`` on 127.0.0.2) need a plane each. Keyed by what the plane is made from, so asking again with the same
arguments returns the same plane and never a second listener.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

Plane = TypeVar("Plane")


class PlaneRegistry(Generic[Plane]):
    """``registry(*key)``: the plane ``make(*key)`` made the first time that key was asked for (thread-safe)."""

    def __init__(self, make: Callable[..., Plane]) -> None:
        self._make = make
        self._planes: dict[tuple, Plane] = {}
        self._lock = threading.Lock()

    def __call__(self, *key: Hashable) -> Plane:
        with self._lock:
            plane = self._planes.get(key)
            if plane is None:
                plane = self._planes[key] = self._make(*key)
            return plane
