"""A device-native data plane for the Messenger: block records move as device arrays pulled between processes with
``jax.experimental.transfer``, while gRPC keeps the control (which blocks, under which pull id, from where).

The paper's transfer engine moves KV with GPUDirect RDMA; JAX's transfer server is the portable form of that: each
process runs one server (``start_transfer_server`` on the default device's client); a sender *offers* arrays under a
pull id (``await_pull``) and a receiver *pulls* them into its own device memory (``connect(address).pull``), over
the backend's fastest path (a socket on CPU loopback, DCN or the interconnect on accelerators). A group of blocks
travels as one ``uint8[n, record_bytes]`` array of their records, so the checksum in every record still guards the
data end to end: the receiver stores each row through ``BlockPool.put_record``, which verifies it.

One plane per listening host in a process (``device_plane()``, ``plane_registry.py``), shared by the Messenger's
servers and clients, started on first use:
importing this module does not import JAX. An offer that is never pulled (the peer died between the control call
and the pull) stays in device memory until the process ends; groups are at most ``PULL_BYTES`` to bound that.
"""

from __future__ import annotations

import datetime
import itertools
import random
import threading
from collections.abc import Sequence

import numpy as np

from mooncake_jax.transfer.plane_registry import PlaneRegistry

PULL_BYTES = 256 << 20
"""Most bytes offered or pulled as one array."""
COPY_BYTES = 1 << 20
PARALLEL_COPIES = 8
"""The transfer server cuts an array into copies of ``COPY_BYTES``, ``PARALLEL_COPIES`` in flight: on CPU loopback
here 1 MiB copies moved 48 MiB arrays 2-5x faster than the default 256 MiB (0.4-0.7 against 0.07-0.2 GB/s, a
loaded 2-core machine)."""


class DevicePlane:
    """This process's JAX transfer server and the connections it opened to peers' servers."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._lock = threading.Lock()
        self._server = None
        self._connections: dict[str, object] = {}
        self._pull_ids = itertools.count(random.getrandbits(48) << 8)  # unique across restarts, in practice

    def _started(self):
        with self._lock:
            if self._server is None:
                import jax
                from jax.experimental import transfer

                self._device = jax.devices()[0]
                self._server = transfer.start_transfer_server(
                    self._device.client, f"{self.host}:0", [f"{self.host}:0"],
                    max_num_parallel_copies=PARALLEL_COPIES, transfer_size=COPY_BYTES,
                )
            return self._server

    @property
    def address(self) -> str:
        """Where peers connect to pull what this process offers."""
        return self._started().address()

    def offer(self, records: Sequence[bytes | memoryview]) -> tuple[str, int]:
        """Put ``records`` (of one length) on the device as one array and offer it; ``(address, pull id)``."""
        import jax

        server = self._started()
        stacked = np.empty((len(records), len(records[0])), np.uint8)
        for row, record in zip(stacked, records):
            row[:] = np.frombuffer(record, np.uint8)
        with self._lock:
            pull_id = next(self._pull_ids)
        server.await_pull(pull_id, [jax.device_put(stacked, self._device)])
        return server.address(), pull_id

    def pull(self, address: str, pull_id: int, count: int, record_bytes: int, timeout_s: float) -> np.ndarray:
        """Pull the ``uint8[count, record_bytes]`` array offered at ``address`` under ``pull_id`` into this device,
        and return it as host memory."""
        import jax

        server = self._started()
        with self._lock:
            connection = self._connections.get(address)
            if connection is None:
                connection = self._connections[address] = server.connect(address)
        wanted = jax.ShapeDtypeStruct((count, record_bytes), np.uint8,
                                      sharding=jax.sharding.SingleDeviceSharding(self._device))
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        (pulled,) = connection.pull(pull_id, [wanted], timeout=deadline)
        return np.asarray(pulled)


_PLANES: PlaneRegistry[DevicePlane] = PlaneRegistry(DevicePlane)


def device_plane(host: str | None = None) -> DevicePlane:
    """This process's ``DevicePlane`` listening on ``host`` (its transfer server starts on first use; by default
    loopback): one per host."""
    return _PLANES(host or "127.0.0.1")


def groups(keys: Sequence[int], record_bytes: int) -> list[list[int]]:
    """``keys`` cut into groups of at most ``PULL_BYTES`` of records (at least one block each)."""
    per_group = max(1, PULL_BYTES // record_bytes)
    return [list(keys[i : i + per_group]) for i in range(0, len(keys), per_group)]
