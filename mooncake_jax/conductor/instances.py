"""Instance table: the per-instance figures the policy reads, as parallel numpy arrays indexed by slot.

A slot is a small integer given to an instance when it registers (the same number is its bit in the block
index). Keeping every figure in a column means the policy predicts TTFT for all prefill instances, and TBT for
all decode instances, in a few array expressions whatever the cluster size, and heterogeneous hardware costs
nothing extra: each slot carries its own cost coefficients.
"""

from __future__ import annotations

import enum

import numpy as np

from mooncake_jax.conductor.costs import InstanceCosts, link_bytes_per_s


class UnknownInstance(KeyError):
    """An instance id that is not registered (never was, was drained, or the Conductor restarted)."""

    def __str__(self) -> str:
        return self.args[0] if self.args else "unknown instance"


class Role(enum.IntEnum):
    """What an instance does; FREE marks an unused slot."""

    FREE = 0
    PREFILL = 1
    DECODE = 2


class InstanceTable:
    """Registered instances by slot.

    Columns (each an array of length ``capacity``):

    - ``role``: Role per slot (FREE for a slot no instance holds).
    - ``queue_free_at``: clock time at which the instance's queued prefill work is predicted to be done.
    - ``send_free_at``: clock time at which the transfers it is sending are predicted to be done.
    - ``prefill_coef`` (4 x capacity), ``decode_coef`` (3 x capacity): cost model coefficients per slot.
    - ``kv_bytes_per_token``, ``nic_bytes_per_s``, ``kv_capacity_tokens``: sizes and bandwidths per slot.
    - ``prefill_slowdown``: measured over predicted seconds of a prefill instance's recent requests (1 until it
      reports one); the policy scales the instance's predicted prefill times by it.
    - ``max_batch``: how many sequences a decode instance runs at once (its scheduler refuses one more), +inf when
      its registration does not say.
    - ``last_seen``: clock time of the instance's last heartbeat.
    - ``decode_time_s``: a decode instance's own uniform decode time t_d (how long its requests decode: faster
      hardware, or a smaller batch, finishes them sooner), tracked by the cluster state.
    - ``link_bytes_per_s`` (capacity x capacity): bandwidth of each sender (row) -> receiver (column) link; the
      slower NIC of the pair unless ``set_link`` gave the pair its own figure (same host, same rack, ...).

    Kept up to date from the columns above, for the policy's hot path (one decision reads them in a single matrix
    product instead of a dozen array operations, see ``policy.py``):

    - ``prefill_terms`` (7 x capacity): rows 0-3 each slot's prefill coefficients scaled by its slowdown (the
      prefill seconds of ``x`` new tokens after a prefix ``p`` are ``(1, x, x^2, x*p)`` times the column), row 4
      ones (a term every slot pays alike); rows 5 and 6 are the policy's scratch, overwritten by each decision
      (the sender's link row, the queues): one buffer instead of a fresh one per decision. Decisions on one table
      are made one at a time (the service holds its lock; the simulator is one thread).
    - ``kv_seconds_per_token`` (capacity x capacity): seconds a sender (row) needs to move one token's KV to a
      receiver (column) at line rate: the receiver's KV bytes per token over the link's bandwidth.
    - ``decode_fixed_s``: c0 + c1 of each slot's decode cost, the step time of a batch of one without context: a
      decode instance's step time with ``b`` more requests is this plus their step shares (``DecodeLedger``).
    - ``batch_limited``: whether some decode instance has a finite ``max_batch``.
    - ``decode_kv_room``: ``kv_capacity_tokens`` on decode slots, -inf elsewhere (one comparison says both "not a
      decode instance" and "its KV would not fit").

    Plus ``ids``/``addresses``/``costs``/``hardware`` lists and ``slot_of`` (instance id -> slot).
    """

    def __init__(self, capacity: int = 16):
        self.ids: list[str | None] = []
        self.addresses: list[str] = []
        self.costs: list[InstanceCosts | None] = []
        self.hardware: list[str] = []
        self.link_bytes_per_s = np.ones((0, 0))
        self._link_overrides: dict[tuple[str, str], float] = {}
        self.slot_of: dict[str, int] = {}
        self.capacity = 0
        self._grow(capacity)

    def __len__(self) -> int:
        return len(self.slot_of)

    def add(self, instance_id: str, role: Role, costs: InstanceCosts, now: float, address: str = "",
            kv_capacity_tokens: int | None = None, hardware: str | None = None, max_batch: int | None = None) -> int:
        """Register an instance in a free slot (the lowest one) and return the slot; ``hardware`` names its kind
        (default: the one its costs name); ``max_batch``: its batch slots (None: unbounded)."""
        if not instance_id:
            raise ValueError("instance id must be a non-empty string")
        if instance_id in self.slot_of:
            raise ValueError(f"instance {instance_id!r} is already registered")
        if role not in (Role.PREFILL, Role.DECODE):
            raise ValueError(f"role must be PREFILL or DECODE, got {role!r}")
        free = np.flatnonzero(self.role == Role.FREE)
        if free.size == 0:
            self._grow(self.capacity)
            free = np.flatnonzero(self.role == Role.FREE)
        slot = int(free[0])
        self.ids[slot], self.addresses[slot], self.costs[slot] = instance_id, address, costs
        self.hardware[slot] = hardware or costs.hardware or costs.name
        self.slot_of[instance_id] = slot
        self.role[slot] = role
        self.queue_free_at[slot] = self.send_free_at[slot] = self.last_seen[slot] = now
        self.prefill_coef[:, slot] = costs.prefill.coef
        self.decode_coef[:, slot] = costs.decode.coef
        self.decode_fixed_s[slot] = self.decode_coef[0, slot] + self.decode_coef[1, slot]
        self.kv_bytes_per_token[slot] = costs.kv_bytes_per_token
        self.nic_bytes_per_s[slot] = costs.nic_bytes_per_s
        capacity = costs.kv_capacity_tokens if kv_capacity_tokens is None else kv_capacity_tokens
        if capacity < 0:
            raise ValueError(f"kv_capacity_tokens must be non-negative, got {capacity}")
        self.kv_capacity_tokens[slot] = capacity
        self.prefill_slowdown[slot] = 1.0
        self._refresh_prefill_terms(slot)
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self.max_batch[slot] = np.inf if max_batch is None else max_batch
        self._refresh_links(slot)
        self._refresh_masks()
        return slot

    def set_link(self, sender: str, receiver: str, bytes_per_s: float) -> None:
        """Give the ``sender`` -> ``receiver`` link its own bandwidth (kept across re-registrations of either)."""
        if not bytes_per_s > 0 or bytes_per_s == float("inf"):
            raise ValueError(f"link bandwidth must be a positive finite number, got {bytes_per_s!r}")
        self._link_overrides[(sender, receiver)] = float(bytes_per_s)
        if sender in self.slot_of and receiver in self.slot_of:
            row, column = self.slot_of[sender], self.slot_of[receiver]
            self.link_bytes_per_s[row, column] = bytes_per_s
            self.kv_seconds_per_token[row, column] = self.kv_bytes_per_token[column] / bytes_per_s

    def set_prefill_slowdown(self, slot: int, slowdown: float) -> None:
        """How much longer than its cost model a prefill instance's recent requests took (validated by the
        caller); its predicted prefill times are scaled by it."""
        self.prefill_slowdown[slot] = slowdown
        self._refresh_prefill_terms(slot)

    def _refresh_prefill_terms(self, slot: int) -> None:
        self.prefill_terms[:4, slot] = self.prefill_coef[:, slot] * self.prefill_slowdown[slot]

    def link(self, sender: int, receiver: int) -> float:
        """Bandwidth of the link between two slots, sender first."""
        return float(self.link_bytes_per_s[sender, receiver])

    def _refresh_links(self, slot: int) -> None:
        """Row and column of a newly registered slot: the slower NIC of each pair, then the pairs' own figures."""
        nic = self.nic_bytes_per_s
        self.link_bytes_per_s[slot, :] = link_bytes_per_s(nic[slot], nic)
        self.link_bytes_per_s[:, slot] = link_bytes_per_s(nic, nic[slot])
        me = self.ids[slot]
        for (sender, receiver), bandwidth in self._link_overrides.items():
            if me in (sender, receiver) and sender in self.slot_of and receiver in self.slot_of:
                self.link_bytes_per_s[self.slot_of[sender], self.slot_of[receiver]] = bandwidth
        self.kv_seconds_per_token = self.kv_bytes_per_token / self.link_bytes_per_s

    def remove(self, instance_id: str) -> int:
        """Free an instance's slot; the caller purges what else refers to the slot first."""
        slot = self.slot(instance_id)
        del self.slot_of[instance_id]
        self.ids[slot], self.addresses[slot], self.costs[slot], self.hardware[slot] = None, "", None, ""
        self.role[slot] = Role.FREE
        self.prefill_coef[:, slot] = 0
        self.decode_coef[:, slot] = 0
        self.decode_fixed_s[slot] = 0.0
        self._refresh_prefill_terms(slot)
        self._refresh_masks()
        return slot

    def slot(self, instance_id: str) -> int:
        """The slot of a registered instance; KeyError naming it otherwise."""
        try:
            return self.slot_of[instance_id]
        except KeyError:
            raise UnknownInstance(f"unknown instance {instance_id!r}; register it (again) first") from None

    def candidates(self, role: Role) -> np.ndarray:
        """Boolean mask of the slots that may take new work in ``role`` (kept up to date, not recomputed)."""
        return self._masks[role]

    def count(self, role: Role) -> int:
        """How many slots hold an instance of ``role``."""
        return self._counts[role]

    def barrier(self, role: Role) -> np.ndarray:
        """0 on the slots of ``role``, +inf elsewhere: ``(score + barrier).argmin()`` picks among them with one
        addition instead of a masked copy (the policy's hot path)."""
        return self._barriers[role]

    def _refresh_masks(self) -> None:
        # lists indexed by the role's value, not dicts keyed by the enum: an Enum hashes in Python code (its
        # name), which cost a microsecond per lookup on the policy's hot path
        roles = (Role.FREE, Role.PREFILL, Role.DECODE)
        self._masks = [self.role == int(role) for role in roles]
        self.decode_kv_room = np.where(self._masks[Role.DECODE], self.kv_capacity_tokens, -np.inf)
        self._barriers = [np.where(mask, 0.0, np.inf) for mask in self._masks]
        self._counts = [int(np.count_nonzero(mask)) for mask in self._masks]
        # whether any decode instance registered its batch slots (else no decision needs to count requests)
        self.batch_limited = bool(np.isfinite(self.max_batch[self._masks[Role.DECODE]]).any())

    def _grow(self, extra: int) -> None:
        for name, (rows, fill, dtype) in _COLUMNS.items():
            tail = np.full((extra,) if rows is None else (rows, extra), fill, dtype)
            old = getattr(self, name, None)
            setattr(self, name, tail if old is None else np.concatenate([old, tail], axis=-1))
        self.ids.extend([None] * extra)
        self.addresses.extend([""] * extra)
        self.costs.extend([None] * extra)
        self.hardware.extend([""] * extra)
        links = np.ones((self.capacity + extra, self.capacity + extra))
        links[: self.capacity, : self.capacity] = self.link_bytes_per_s
        self.link_bytes_per_s = links
        self.kv_seconds_per_token = self.kv_bytes_per_token / links
        self.prefill_terms = np.concatenate([self.prefill_coef * self.prefill_slowdown, np.ones((1, len(links))),
                                             np.zeros((2, len(links)))])
        self.capacity += extra
        self._refresh_masks()


_COLUMNS = {  # column: (rows, or None for one value per slot; fill value of a free slot; dtype)
    "role": (None, Role.FREE, np.int8),
    "queue_free_at": (None, 0.0, float),
    "send_free_at": (None, 0.0, float),
    "last_seen": (None, 0.0, float),
    "decode_time_s": (None, 1.0, float),
    "prefill_coef": (4, 0.0, float),
    "decode_coef": (3, 0.0, float),
    "decode_fixed_s": (None, 0.0, float),
    "kv_bytes_per_token": (None, 1.0, float),
    "nic_bytes_per_s": (None, 1.0, float),
    "kv_capacity_tokens": (None, 0.0, float),
    "max_batch": (None, np.inf, float),
    "prefill_slowdown": (None, 1.0, float),
}
