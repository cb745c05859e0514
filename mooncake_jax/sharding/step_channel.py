"""How process 0 of a multi-process instance hands every device operation to the other processes.

In JAX's multi-controller runtime every process must launch the same programs, with the same global shapes, in the
same order. Only process 0 runs the control plane (gRPC, scheduler, page bookkeeping), so before each operation it
sends the operation and its host inputs (step arrays, pages, blocks) here; the other processes receive them in a
follower loop (``instance.distributed.follow``) and launch the same program. One operation at a time, in order.

The transport is the key-value store of JAX's own coordination service (the one ``jax.distributed`` starts in
process 0 and every process is connected to): message n is pickled, cut into parts of at most ``PART_BYTES`` (under
gRPC's message limit), and set under ``step/n``; each follower waits for that key, reads it, and counts itself
as having read it; the last reader deletes it, so the store holds only messages not yet read by everyone.

This replaced a broadcast through the device collectives (``multihost_utils.broadcast_one_to_all``: a length, then
the padded message, each a jitted psum over gloo): measured on this machine (2 processes, a 30 KB message, load
~15) that took 95-110 ms per message against about 1 ms here, which made a short prefill several times slower
than in one process. Messages are pickled: they travel only between the processes of one instance, through the
service JAX itself sets up between them.
"""

from __future__ import annotations

import pickle
import struct
import time

STOP = "stop"
"""The operation that ends the followers' loop (process 0 sends it when the instance stops)."""

PART_BYTES = 1 << 20
"""Largest value set under one key (gRPC's default message limit is 4 MiB)."""

WAIT_MS = 60_000
"""How long one wait for the next message lasts; an idle follower simply waits again."""

_HEADER = struct.Struct("<q")  # the message's part count, before its first part


class StepChannel:
    """Process 0 ``send`` s (operation, payload) messages; every other process ``recv`` s them, in order.

    ``client``: the coordination service's client (default: the one ``jax.distributed.initialize`` made);
    ``process_index`` / ``process_count`` default to JAX's.
    """

    def __init__(self, client=None, process_index: int | None = None, process_count: int | None = None,
                 prefix: str = "mooncake/step"):
        if client is None or process_index is None or process_count is None:
            import jax
            from jax._src import distributed  # the client jax.distributed made (no public accessor)

            client = client if client is not None else distributed.global_state.client
            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        if client is None:
            raise RuntimeError("a StepChannel needs jax.distributed to be initialized (a multi-process instance)")
        self.client, self.prefix = client, prefix
        self.process_index, self.followers = process_index, process_count - 1
        self.is_leader = process_index == 0
        self._next = 0  # the number of the next message sent or received

    def _key(self, n: int, part: int = 0) -> str:
        return f"{self.prefix}/{n}" if part == 0 else f"{self.prefix}/{n}/part{part}"

    def send(self, message) -> None:
        if not self.is_leader:
            raise RuntimeError(f"only process 0 sends instance operations (this is process {self.process_index})")
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        parts = [data[i: i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
        n, self._next = self._next, self._next + 1
        for i in range(1, len(parts)):  # the later parts first: a follower that sees the key finds them all
            self.client.key_value_set_bytes(self._key(n, i), parts[i])
        self.client.key_value_set_bytes(self._key(n), _HEADER.pack(len(parts)) + parts[0])

    def recv(self):
        if self.is_leader:
            raise RuntimeError("process 0 sends instance operations; it never receives them")
        n, self._next = self._next, self._next + 1
        head = self._wait(self._key(n))
        (count,) = _HEADER.unpack_from(head)
        parts = [head[_HEADER.size:]] + [self.client.blocking_key_value_get_bytes(self._key(n, i), WAIT_MS)
                                        for i in range(1, count)]
        if self.client.key_value_increment(f"{self._key(n)}/read", 1) == self.followers:  # the last reader
            for i in range(count):
                self.client.key_value_delete(self._key(n, i))
            self.client.key_value_delete(f"{self._key(n)}/read")
        return pickle.loads(b"".join(parts))

    def _wait(self, key: str) -> bytes:
        """The value of ``key`` once process 0 sets it, however long the instance stays idle (each wait ends after
        ``WAIT_MS`` and starts again; an error that is not that timeout is raised). A process 0 that died ends this
        process through JAX's heartbeat."""
        while True:
            t = time.monotonic()
            try:
                return self.client.blocking_key_value_get_bytes(key, WAIT_MS)
            except Exception:
                if time.monotonic() - t < 0.9 * WAIT_MS / 1000:  # not the wait running out: a real error
                    raise
