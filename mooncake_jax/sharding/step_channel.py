"""How process 0 of a multi-process instance hands every device operation to the other processes.

In JAX's multi-controller runtime every process must launch the same programs, with the same global shapes, in the
same order. Only process 0 runs the control plane (gRPC, scheduler, page bookkeeping), so before each operation it
sends the operation and its host inputs (step arrays, pages, blocks) here; the other processes receive them in a
follower loop (``instance.distributed.follow``) and launch the same program. One operation at a time, in order.

The transport is JAX's own collective (``multihost_utils.broadcast_one_to_all``, gloo on CPU): a fixed-size length
header, then the pickled message padded to a power-of-two size, so the broadcast compiles a handful of programs,
not one per message. Messages are pickled: they travel only between the processes of one instance, over the
collective JAX itself sets up between them.
"""

from __future__ import annotations

import pickle

import numpy as np

STOP = "stop"
"""The operation that ends the followers' loop (process 0 sends it when the instance stops)."""

MIN_MESSAGE_BYTES = 4096


def padded_size(n: int) -> int:
    """The smallest power of two >= n (and >= MIN_MESSAGE_BYTES): the broadcast buffer's size for n bytes."""
    size = MIN_MESSAGE_BYTES
    while size < n:
        size *= 2
    return size


class StepChannel:
    """Process 0 ``send`` s (operation, payload) messages; every other process ``recv`` s them, in order."""

    def __init__(self):
        import jax

        self.process_index = jax.process_index()
        self.is_leader = self.process_index == 0

    def send(self, message) -> None:
        if not self.is_leader:
            raise RuntimeError(f"only process 0 sends instance operations (this is process {self.process_index})")
        data = np.frombuffer(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        self._broadcast(np.array([data.size], np.int64))
        buffer = np.zeros(padded_size(data.size), np.uint8)
        buffer[: data.size] = data
        self._broadcast(buffer)

    def recv(self):
        if self.is_leader:
            raise RuntimeError("process 0 sends instance operations; it never receives them")
        n = int(self._broadcast(np.zeros(1, np.int64))[0])
        buffer = self._broadcast(np.zeros(padded_size(n), np.uint8))
        return pickle.loads(buffer[:n].tobytes())

    @staticmethod
    def _broadcast(array: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(array))
