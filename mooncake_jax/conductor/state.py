"""Cluster state: the Conductor's mutable picture of the cluster, which the policy reads through snapshots.

Two sources keep it current. Decisions are applied the moment they are made: the chosen prefill instance's
queue grows by the request's predicted time, the sender's outgoing transfers by the planned bytes, the decode
instance gains a ledger entry starting when the prefill is predicted to end, and the chosen instance is
recorded as holding the request's blocks (fetched ones included: that is hot-block replication). So a burst of
requests spreads over instances instead of all landing on the one that looked idle. Reports then correct the
predictions: heartbeats (queued work, running decode batch), KV events (blocks stored, evicted, or a whole
list re-sent), and per-request milestones (prefill done, decode begun, finished, dropped).

A prefill instance's heartbeat counts only the requests that have reached it (``conductor/accounting.py``,
"Queue"); the ones the Conductor has sent it that are still on their way (the decision's reply, the Prefill RPC,
fetching and staging their prefix) are added back from the Conductor's own predictions when the heartbeat names
the requests it holds (``heartbeat``'s ``active``), so a heartbeat in the middle of a burst does not wipe the
burst's decisions from the instance's queue.

Both the gRPC service and the simulator own one ``ClusterState`` and call ``schedule`` plus these reports.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from mooncake_jax.conductor import index_kernels
from mooncake_jax.conductor.api import Decision, PolicyConfig, Request, Snapshot
from mooncake_jax.conductor.costs import InstanceCosts, transfer_seconds
from mooncake_jax.conductor.flat_index import FlatBlockIndex
from mooncake_jax.conductor.index import BlockIndex, Tier
from mooncake_jax.conductor.instances import InstanceTable, Role
from mooncake_jax.conductor.ledger import DecodeLedger

_NO_SLOTS = np.zeros(0, np.intp)


class RequestInFlight(ValueError):
    """A request id that is already in flight (ALREADY_EXISTS over gRPC)."""

IN_FLIGHT_MAX_S = 10.0
"""A decision older than this whose prefill instance still does not hold its request is no longer added to that
instance's queue (its Prefill RPC failed and nobody reported it dropped): a lost report must not starve an instance
for good. Requests reach their instance within tens of milliseconds on a loaded 2-core host (the Prefill RPC and
staging its prefix, ``instance/prefill.py``), a planned fetch within ``FETCH_WAIT_S`` (2 s) more."""

INDEX_RESERVE_MAX_KEYS = 1 << 22
"""Most keys the block index is sized for ahead of them (``add_instance``'s ``index_blocks``): 6M rows, ~144 MB with
up to 64 instances; past it, the index doubles as it fills."""


class ClusterState:
    """Instances, block index, decode ledger and the tracked decode time t_d."""

    def __init__(self, config: PolicyConfig | None = None, compiled: bool = True):
        """``compiled``: keep the block index in compiled flat tables (``FlatBlockIndex``) where numba is installed
        (compiled, or read from numba's cache, here); the dict ``BlockIndex`` answers the same, at a few microseconds
        more a decision."""
        self.config = config or PolicyConfig()
        self.instances = InstanceTable()
        ops = index_kernels.compiled() if compiled else None
        self.index = BlockIndex() if ops is None else FlatBlockIndex(ops)
        self.ledger = DecodeLedger(instances=self.instances)
        self._tracked_decode_s = self.config.decode_time_init_s
        self._decode_s_of_kind: dict[str, float] = {}  # hardware kind -> its tracked t_d
        # hardware kind -> its slots, as an index array: a finish updates the kind's t_d on all of them in one write
        # (a Python loop over a kind's ~40 slots cost ~3 us a finished request)
        self._slots_of_kind: dict[str, np.ndarray] = {}
        self._prefill_of: dict[str, int] = {}  # request -> prefill slot, until its prefill is reported done
        # prefill slot -> {request: (predicted prefill seconds, decided at)} for the same requests: what a heartbeat
        # that names the requests its instance holds adds back for the ones not there yet (``heartbeat``)
        self._sent_to: dict[int, dict[str, tuple[float, float]]] = {}
        self._snapshot: Snapshot | None = None
        self._index_blocks: dict[str, int] = {}  # instance -> the blocks its pool can publish (``add_instance``)

    # ------------------------------------------------------------------------------------------- reading

    @property
    def decode_time_s(self) -> float:
        """t_d: the configured uniform decode time, or the moving average of reported ones, cluster-wide."""
        fixed = self.config.decode_time_s
        return self._tracked_decode_s if fixed is None else fixed

    def decode_time_of(self, instance_id: str) -> float:
        """A decode instance's own t_d (the configured one when fixed): the moving average of the decode times
        reported by the finished requests of the instances of its hardware kind, starting from the cluster-wide
        figure when the first of them registered.

        Why per kind and not per instance: instances of one kind are interchangeable, so their t_d estimate one
        quantity, and pooling their samples keeps the estimate as steady as the cluster-wide one. Measured on the
        overload experiment (8 + 8 A800 nodes, LLaMA-65B, 2x): one moving average per instance, each fed an
        eighth of the samples, rejected 1,112 instead of 1,064 requests at TBT 100 ms (SLO attainment 0.715
        instead of 0.743); per kind, a homogeneous pool keeps the cluster-wide figures exactly."""
        fixed = self.config.decode_time_s
        return float(self.instances.decode_time_s[self.instances.slot(instance_id)]) if fixed is None else fixed

    def snapshot(self) -> Snapshot:
        """The policy's view of this state (the same object while t_d and the table's columns stay: a frozen
        dataclass costs about a microsecond to build, a hundredth of a decision)."""
        per_slot = self.instances.decode_time_s if self.config.decode_time_s is None else None
        decode_time_s = self.decode_time_s
        snapshot = self._snapshot
        if snapshot is None or snapshot.decode_times is not per_slot or snapshot.decode_time_s != decode_time_s:
            snapshot = self._snapshot = Snapshot(self.instances, self.index, self.ledger, decode_time_s, per_slot)
        return snapshot

    def schedule(self, policy, request: Request, now: float, store_blocks: bool = True) -> Decision:
        """Decide for ``request`` and, if accepted, apply the decision at once."""
        if request.request_id in self.ledger or request.request_id in self._prefill_of:
            raise RequestInFlight(f"request {request.request_id!r} is already in flight")
        decision = policy.decide(request, self.snapshot(), now)
        self.apply(request, decision, now, store_blocks, fresh=True)
        return decision

    def apply(self, request: Request, decision: Decision, now: float, store_blocks: bool = True,
              fresh: bool = False) -> None:
        """Count an accepted decision's load now (rejections change nothing).

        ``store_blocks``: record the prefill instance as holding the request's blocks right away (the default:
        requests queued behind it there will find them). A simulator that emits KV events when the blocks
        really land passes False. ``fresh``: the decision was made on this very state (``schedule``), so the
        prefill instance holds the leading blocks it matched, and recording them is skipped.
        """
        if not decision.accepted:
            return
        table = self.instances
        prefill, decode = table.slot(decision.prefill), table.slot(decision.decode)
        end = decision.prefill_end_at
        if end > table.queue_free_at.item(prefill):
            table.queue_free_at[prefill] = end
        if decision.transfer is not None:
            source = table.slot(decision.transfer.source)
            table.send_free_at[source] = now + float(transfer_seconds(
                decision.transfer.n_bytes, table.link(source, prefill), table.send_free_at[source] - now))
        self.ledger.add(request.request_id, decode, end, request.kv_tokens)
        self._prefill_of[request.request_id] = prefill
        self._sent_to.setdefault(prefill, {})[request.request_id] = (decision.prefill_s, now)
        if store_blocks:
            held = 0
            if fresh:  # its own matched prefix: the decision's prefix less what it fetches
                held = decision.prefix_blocks - (len(decision.transfer.keys) if decision.transfer else 0)
            self.index.expect(prefill, request.block_keys, end, held)
            self.index.settle(prefill, now)

    # ---------------------------------------------------------------------------------------- membership

    def add_instance(self, instance_id: str, role: Role | str, costs: InstanceCosts, now: float, address: str = "",
                     kv_capacity_tokens: int | None = None, hardware: str | None = None,
                     max_batch: int | None = None, index_blocks: int = 0) -> int:
        """Register an instance with its own cost model (a re-registration replaces the old one and its blocks);
        returns its slot. ``hardware`` names its kind (default: what ``costs`` names); ``max_batch``: a decode
        instance's batch slots (None: unbounded); ``index_blocks``: the blocks its pool can publish to the index
        (the index is sized ahead for the registered instances' sum, up to ``INDEX_RESERVE_MAX_KEYS``)."""
        if not isinstance(index_blocks, int) or isinstance(index_blocks, bool) or index_blocks < 0:
            raise ValueError(f"index_blocks must be a non-negative integer, got {index_blocks!r}")
        role = Role[role.upper()] if isinstance(role, str) else Role(role)
        if instance_id in self.instances.slot_of:
            self.remove_instance(instance_id)
        slot = self.instances.add(instance_id, role, costs, now, address, kv_capacity_tokens, hardware, max_batch)
        kind = self.instances.hardware[slot]
        self._slots_of_kind[kind] = np.append(self._slots_of_kind.get(kind, _NO_SLOTS), slot)
        # a new kind starts from the cluster-wide figure, until its own requests report theirs
        self.instances.decode_time_s[slot] = self._decode_s_of_kind.setdefault(kind, self._tracked_decode_s)
        if index_blocks:
            self._index_blocks[instance_id] = index_blocks
            self.index.reserve(min(INDEX_RESERVE_MAX_KEYS, sum(self._index_blocks.values())))
        return slot

    def set_link(self, sender: str, receiver: str, bytes_per_s: float, both_ways: bool = True) -> None:
        """Give a pair of instances its own link bandwidth (default: the slower NIC of the two); it holds across
        re-registrations, and may name instances not registered yet."""
        self.instances.set_link(sender, receiver, bytes_per_s)
        if both_ways:
            self.instances.set_link(receiver, sender, bytes_per_s)

    def remove_instance(self, instance_id: str) -> list[str]:
        """Drop an instance, purge its blocks, and forget requests that can no longer complete there.

        Returns the ids of the requests lost with it (queued on it for prefill, or decoding on it).
        """
        slot = self.instances.slot(instance_id)
        kind = self.instances.hardware[slot]
        if kind in self._slots_of_kind:
            slots = self._slots_of_kind[kind]
            self._slots_of_kind[kind] = slots[slots != slot]
        self.index.purge(slot)
        self._index_blocks.pop(instance_id, None)
        lost = self.ledger.remove_slot(slot)
        for request_id in lost:
            self._forget_prefill(request_id)
        stranded = [r for r, s in self._prefill_of.items() if s == slot]
        for request_id in stranded:
            self._forget_prefill(request_id)
            self.ledger.remove(request_id)
        self._sent_to.pop(slot, None)
        self.instances.remove(instance_id)
        return lost + stranded

    def expire(self, now: float, timeout_s: float) -> list[str]:
        """Remove every instance whose last heartbeat is older than ``timeout_s``; returns their ids."""
        table = self.instances
        dead = [i for i, s in table.slot_of.items() if now - table.last_seen[s] > timeout_s]
        for instance_id in dead:
            self.remove_instance(instance_id)
        return dead

    # ------------------------------------------------------------------------------------------- reports

    def heartbeat(self, instance_id: str, now: float, queued_s: float | None = None,
                  send_backlog_s: float | None = None, active: Mapping[str, int] | None = None,
                  prefill_slowdown: float | None = None) -> None:
        """An instance's periodic load report; each given figure replaces the Conductor's running estimate.

        ``queued_s``: predicted seconds of prefill work queued (its queue drains at now + queued_s).
        ``prefill_slowdown``: how much longer than its cost model a prefill instance's recent requests took
        (a host loaded by other work, a lower priority); its predicted prefill times are scaled by it.
        ``send_backlog_s``: seconds of outgoing transfers queued. ``active``: a decode instance's running
        batch, request id -> KV tokens: entries it no longer runs are dropped, unknown ones added. From a prefill
        instance, the requests it holds (counted in its ``queued_s``, or computed and not yet reported done): the
        requests the Conductor sent it that it does not hold yet are on their way, and their predicted seconds
        (as decided, for decisions of the last ``IN_FLIGHT_MAX_S``) are added to ``queued_s``
        (``conductor/accounting.py``, "Queue"). Without ``active`` the figure replaces the queue as it is.
        """
        table = self.instances
        slot = table.slot(instance_id)
        for name, value in (("queued_s", queued_s), ("send_backlog_s", send_backlog_s)):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
        if prefill_slowdown is not None:
            if not (math.isfinite(prefill_slowdown) and prefill_slowdown > 0):
                raise ValueError(f"prefill_slowdown must be a finite positive number, got {prefill_slowdown!r}")
            table.set_prefill_slowdown(slot, prefill_slowdown)
        table.last_seen[slot] = now
        prefill = table.role[slot] == Role.PREFILL
        if queued_s is not None:
            if prefill and active is not None:
                queued_s += self.on_the_way_s(instance_id, now, active)
            table.queue_free_at[slot] = now + queued_s
        if send_backlog_s is not None:
            table.send_free_at[slot] = now + send_backlog_s
        if active is not None and not prefill:
            self._reconcile_batch(slot, now, active)

    def on_the_way_s(self, instance_id: str, now: float, held: Iterable[str]) -> float:
        """Predicted prefill seconds of the requests sent to prefill instance ``instance_id`` (decided within the
        last ``IN_FLIGHT_MAX_S``) that are not among the ``held`` ones (that have not reached it yet)."""
        sent = self._sent_to.get(self.instances.slot(instance_id))
        if not sent:
            return 0.0
        held = held if isinstance(held, (set, frozenset, dict)) else set(held)
        return sum(s for request_id, (s, at) in sent.items() if request_id not in held and now - at <= IN_FLIGHT_MAX_S)

    def _forget_prefill(self, request_id: str) -> None:
        """The request's prefill is done (or it ended): its instance's queue no longer counts it."""
        slot = self._prefill_of.pop(request_id, None)
        if slot is not None:
            sent = self._sent_to.get(slot)
            if sent is not None:
                sent.pop(request_id, None)

    def _reconcile_batch(self, slot: int, now: float, active: Mapping[str, int]) -> None:
        for request_id in self.ledger.ids_on(slot, started_only=True):
            if request_id not in active:
                self.ledger.remove(request_id)
        for request_id, tokens in active.items():
            known = self.ledger.get(request_id)
            if known is None:
                self.ledger.add(request_id, slot, now, tokens, started=True)
            elif not known[3]:
                self.ledger.set_start(request_id, min(known[1], now))
            self._forget_prefill(request_id)

    def kv_stored(self, instance_id: str, keys: Iterable[int], tier: Tier = Tier.DRAM) -> None:
        self.index.store(self.instances.slot(instance_id), keys, tier)

    def kv_removed(self, instance_id: str, keys: Iterable[int]) -> None:
        self.index.remove(self.instances.slot(instance_id), keys)

    def kv_reset(self, instance_id: str, dram_keys: Iterable[int], ssd_keys: Iterable[int] = ()) -> None:
        """Replace an instance's whole block list (sent after registering with a restarted Conductor)."""
        self.index.reset(self.instances.slot(instance_id), dram_keys, ssd_keys)

    def prefill_done(self, request_id: str, now: float) -> bool:
        """The request's first token is out; its KV heads for decode now. False if it is not in flight."""
        self._forget_prefill(request_id)
        return self.ledger.set_start(request_id, now, started=False)

    def decode_started(self, request_id: str, now: float) -> bool:
        self._forget_prefill(request_id)
        return self.ledger.set_start(request_id, now, started=True)

    def finished(self, request_id: str, now: float) -> bool:
        """The request completed; its decode duration feeds the tracked t_d, the cluster's and its decode
        instance's hardware kind's."""
        entry = self.ledger.get(request_id)
        self._forget_prefill(request_id)
        if entry is None:
            return False
        self.ledger.remove(request_id)
        if entry[3] and now >= entry[1]:
            weight, duration = self.config.decode_time_smoothing, now - entry[1]
            self._tracked_decode_s += weight * (duration - self._tracked_decode_s)
            kind = self.instances.hardware[entry[0]]
            if kind in self._decode_s_of_kind:  # (an instance gone since: its kind's figure stays as it was)
                tracked = self._decode_s_of_kind[kind]
                tracked += weight * (duration - tracked)
                self._decode_s_of_kind[kind] = tracked
                self.instances.decode_time_s[self._slots_of_kind[kind]] = tracked
        return True

    def dropped(self, request_id: str) -> bool:
        """The request ended without completing (late rejection, failure, client gone)."""
        self._forget_prefill(request_id)
        return self.ledger.remove(request_id)
