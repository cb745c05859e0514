"""Decode ledger: every request routed to a decode instance, with when its decode starts and the KV it holds.

The Conductor needs decode load at a chosen moment T, not only now: the predictive admission policy asks what the
batch will be when this request's prefill ends, which depends on which routed requests will have arrived by T and
which will have finished (after the uniform decode time t_d). Entries live in flat numpy arrays, so the load of
every decode instance at any T is one vectorised pass over the in-flight requests.

An entry's ``start`` is predicted (its prefill's predicted end) until the instance reports the real one.

Predicted decode window of an entry, seen at clock time ``now`` with the uniform decode time t_d:

- not yet decoding: it cannot have spent any decode time, so it starts at max(start, now) and ends t_d later;
- decoding: it ends at start + t_d, unless that has already passed. A request still decoding past t_d (its
  finish not reported) has shown it is one of the long ones; it stays until its finish is reported. Dropping
  it at start + t_d while short requests leave at their reported finish would count each request for
  min(duration, t_d) instead of its duration: with t_d the mean duration, that undercounts the decode load
  by the mean excess over t_d (about a quarter of the requests and a third of the KV on the conversation
  trace), so predictive admission would accept requests the decode side then rejects late.
"""

from __future__ import annotations

import numpy as np

_FREE = -1


class DecodeLedger:
    """In-flight decode requests: slot, start time, KV tokens; loads per slot for the admission views.

    ``instances``: the instance table whose decode cost coefficients give each entry its *step share*, what it
    adds to its instance's decode step time (c1 + c2 * its KV tokens, with step time c0 + c1 * batch + c2 *
    context): the policy then reads a slot's step time as one weighted sum over the entries instead of
    recombining request and token counts per slot (fewer numpy calls on the hot path). Without a table the shares
    are 0 and only the counts and tokens are meaningful."""

    def __init__(self, capacity: int = 1024, instances=None):
        self._instances = instances
        self._slot = np.full(capacity, _FREE, np.int64)
        self._bucket = np.zeros(capacity, np.int64)  # slot + 1, 0 for a free entry: bincount drops bucket 0
        self._pair_bucket = np.zeros(capacity, np.int64)  # 2 * (slot + 1), 0 for a free entry
        self._start = np.zeros(capacity)
        self._tokens = np.zeros(capacity)
        self._step = np.zeros(capacity)  # step share: c1 + c2 * tokens of its slot's decode cost
        self._ones = np.ones(capacity)
        self._started = np.zeros(capacity, bool)
        self._ids: list[str | None] = [None] * capacity
        self._entry_of: dict[str, int] = {}
        self._free: list[int] = []
        self._used = 0  # entries [0, _used) have ever been taken; the rest are untouched
        self._views = None  # the columns' [0, _used) views for decision_loads, while _used and the arrays stay

    def __len__(self) -> int:
        return len(self._entry_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entry_of

    def add(self, request_id: str, slot: int, start: float, tokens: float, started: bool = False) -> None:
        """Route ``request_id`` to decode ``slot``; ``start`` is when its decode begins (predicted or real)."""
        if request_id in self._entry_of:
            raise ValueError(f"request {request_id!r} is already in flight")
        if self._free:
            entry = self._free.pop()
        else:
            if self._used == len(self._slot):
                self._grow()
            entry = self._used
            self._used += 1
            self._views = None
        self._slot[entry], self._start[entry], self._tokens[entry] = slot, start, tokens
        if self._instances is not None:
            coef = self._instances.decode_coef
            self._step[entry] = coef.item(1, slot) + coef.item(2, slot) * tokens
        self._bucket[entry] = slot + 1
        self._pair_bucket[entry] = 2 * (slot + 1)
        self._started[entry] = started
        self._ids[entry] = request_id
        self._entry_of[request_id] = entry

    def get(self, request_id: str) -> tuple[int, float, float, bool] | None:
        """(slot, start, tokens, started) of an in-flight request, or None."""
        entry = self._entry_of.get(request_id)
        if entry is None:
            return None
        return (int(self._slot[entry]), float(self._start[entry]), float(self._tokens[entry]),
                bool(self._started[entry]))

    def set_start(self, request_id: str, start: float, started: bool = True) -> bool:
        """Correct a request's start time (prefill done, or decode begun when ``started``); False if unknown."""
        entry = self._entry_of.get(request_id)
        if entry is None:
            return False
        self._start[entry] = start
        self._started[entry] |= started
        return True

    def remove(self, request_id: str) -> bool:
        """Forget a request (finished, rejected late, failed); False if it was not in flight."""
        entry = self._entry_of.pop(request_id, None)
        if entry is None:
            return False
        self._slot[entry] = _FREE
        self._bucket[entry] = 0
        self._pair_bucket[entry] = 0
        self._ids[entry] = None
        self._free.append(entry)
        return True

    def ids_on(self, slot: int, started_only: bool = False) -> list[str]:
        """Requests routed to ``slot`` (only those whose decode has begun when ``started_only``)."""
        mask = self._slot[: self._used] == slot
        if started_only:
            mask &= self._started[: self._used]
        return [self._ids[e] for e in np.flatnonzero(mask)]

    def remove_slot(self, slot: int) -> list[str]:
        """Forget every request on ``slot`` (instance gone); returns their ids."""
        ids = self.ids_on(slot)
        for request_id in ids:
            self.remove(request_id)
        return ids

    # Load views: each is a mask over the entries, which ``per_slot`` or ``on_slot`` sums into load figures.
    # Free entries may pass a mask; the sums leave them out.

    def active(self, now: float) -> np.ndarray:
        """Current load: requests whose decode has begun by ``now`` (as reported, or predicted) and not finished."""
        return self._start[: self._used] <= now

    def window(self, now: float, decode_s) -> tuple[np.ndarray, np.ndarray]:
        """(begin, end) of every entry's predicted decode, seen at ``now`` (see the module docstring).
        ``decode_s``: t_d, one for all, or one per decode slot (an array indexed by slot: each entry takes its
        instance's)."""
        start, started = self._start[: self._used], self._started[: self._used]
        if isinstance(decode_s, np.ndarray):  # free entries (slot -1) take some slot's: every view drops them
            decode_s = decode_s[self._slot[: self._used]]
        begin = np.maximum(start, now)
        np.copyto(begin, start, where=started)  # in place: cheaper than np.where here
        end = begin + decode_s
        np.putmask(end, started & (end <= now), np.inf)  # in place: a third of np.where's cost here
        return begin, end

    def at(self, when: float, decode_s, now: float) -> np.ndarray:
        """Predicted load at ``when`` (>= ``now``): begun by then and not yet through their decode time."""
        begin, end = self.window(now, decode_s)
        return (begin <= when) & (end > when)

    def committed(self, when: float, decode_s, now: float) -> np.ndarray:
        """Requests that will share a batch with one arriving at ``when``: all not finished by then, including
        those still in prefill (a routed request counts at once, so a burst spreads over instances)."""
        return self.window(now, decode_s)[1] > when

    def per_slot(self, mask: np.ndarray, n_slots: int) -> tuple[np.ndarray, np.ndarray]:
        """(requests, kv_tokens) per slot, float arrays of length ``n_slots``, over the entries in ``mask``."""
        bucket = self._bucket[: self._used]  # free entries fall in bucket 0, dropped below
        # the mask as weights, not as a selection: two passes instead of four, no copies of the selected entries
        return (np.bincount(bucket, weights=mask, minlength=n_slots + 1)[1 : n_slots + 1],
                np.bincount(bucket, weights=self._tokens[: self._used] * mask, minlength=n_slots + 1)[1 : n_slots + 1])

    def decision_loads(self, now: float, when: float, decode_s, n_slots: int, seen_now: bool, count: bool = True,
                       routed_kv: bool = True):
        """The per-slot loads one decision reads, from one pass over the entries: the routed load
        (``committed(when, ...)``: every entry not predicted finished by ``when``) and the load admission judges
        (``at(when, ...)``, or ``active(now)`` when ``seen_now``). Returns (routed step shares, routed kv tokens,
        seen step shares, seen kv tokens, seen requests), float arrays of length ``n_slots`` (a slot's step time
        with a batch is c0 + c1 + its step shares' sum: see the class docstring); seen requests None unless
        ``count`` (only a batch limit needs them: one sum fewer), routed kv tokens None unless ``routed_kv`` (only
        the admission policies that leave the decode checks to the decode instance read it).

        The same masks and sums as ``window`` / ``committed`` / ``at`` / ``per_slot`` (whose docstrings say why),
        written once inline: on the policy's hot path a decision is a fixed count of numpy calls on short arrays,
        each costing its fixed overhead (twice that with a Python scalar operand), and the Python around them
        (method calls, re-slicing the columns per view) cost as much again."""
        if not self._used:  # (bincount of nothing gives integers)
            return (*(np.zeros(n_slots) for _ in range(4)), np.zeros(n_slots) if count else None)
        start, started, slots, tokens, step, pair_bucket, ones = self.columns()
        if isinstance(decode_s, np.ndarray):
            decode_s = decode_s.take(slots)
        begin = np.maximum(start, now)
        np.copyto(begin, start, where=started)
        end = begin + decode_s
        committed = end > when
        overdue = end <= now  # decoding past t_d: its end is +inf (the module docstring says why)
        overdue &= started
        committed |= overdue
        stop = n_slots + 1
        if seen_now:  # the current load, not a part of the routed one: each entry in bucket 4 * (slot + 1)
            seen = start <= now  # + 2 * committed + seen (free entries: 0 to 3, dropped)
            code = pair_bucket + committed
            code += code
            code += seen
            shares, kv = (np.bincount(code, weights, 4 * stop).reshape(stop, 4)[1:] for weights in (step, tokens))
            counts = np.bincount(code, ones, 4 * stop).reshape(stop, 4)[1:] if count else None
            return (shares[:, 2] + shares[:, 3], kv[:, 2] + kv[:, 3] if routed_kv else None,
                    shares[:, 1] + shares[:, 3], kv[:, 1] + kv[:, 3], counts[:, 1] + counts[:, 3] if count else None)
        # begun by ``when``: begin <= when, and begin = max(start, now) or start, so start <= when
        seen = start <= when if when >= now else begin <= when
        # a part of the routed load: each routed entry in bucket 2 * (slot + 1) + seen, the others in bucket 0,
        # dropped; counts weighted by ones, so that the policy's arithmetic on them is float with float (mixed
        # integer and float operations cost more than the weights)
        # (slot s's routed-not-seen sum at flat index 2 * s + 2, its seen sum at 2 * s + 3: strided slices of the
        # flat sums, no reshape)
        code = pair_bucket + seen
        code *= committed
        shares = np.bincount(code, step, 2 * stop)
        kv = np.bincount(code, tokens, 2 * stop)
        seen_shares, seen_kv = shares[3::2], kv[3::2]
        return (shares[2::2] + seen_shares, kv[2::2] + seen_kv if routed_kv else None, seen_shares, seen_kv,
                np.bincount(code, ones, 2 * stop)[3::2] if count else None)

    def columns(self) -> tuple[np.ndarray, ...]:
        """Views of the used entries' columns (start, started, slot, tokens, step share, 2 * (slot + 1), ones), the
        same objects while the ledger's high-water mark and arrays stay (slicing seven columns costs about two numpy
        calls' time, and the mark moves a few times per thousand decisions). Free entries have slot -1."""
        views = self._views
        if views is None:
            used = self._used
            views = self._views = tuple(column[:used] for column in (
                self._start, self._started, self._slot, self._tokens, self._step, self._pair_bucket, self._ones))
        return views

    def on_slot(self, mask: np.ndarray, slot: int) -> tuple[int, float]:
        """(requests, kv_tokens) on one slot over the entries in ``mask``."""
        mine = mask & (self._slot[: self._used] == slot)
        return int(np.count_nonzero(mine)), float(self._tokens[: self._used][mine].sum())

    def next_finish(self, slot: int | None, now: float, decode_s) -> float | None:
        """Earliest predicted decode end after ``now`` on ``slot`` (any slot when None), or None."""
        ends = self.window(now, decode_s)[1]
        slots = self._slot[: self._used]
        mask = (ends > now) & np.isfinite(ends) & (slots >= 0 if slot is None else slots == slot)
        return float(ends[mask].min()) if mask.any() else None

    def _grow(self) -> None:
        extra = len(self._slot)
        self._slot = np.concatenate([self._slot, np.full(extra, _FREE, np.int64)])
        self._bucket = np.concatenate([self._bucket, np.zeros(extra, np.int64)])
        self._pair_bucket = np.concatenate([self._pair_bucket, np.zeros(extra, np.int64)])
        self._start = np.concatenate([self._start, np.zeros(extra)])
        self._tokens = np.concatenate([self._tokens, np.zeros(extra)])
        self._step = np.concatenate([self._step, np.zeros(extra)])
        self._ones = np.ones(len(self._tokens))
        self._started = np.concatenate([self._started, np.zeros(extra, bool)])
        self._ids.extend([None] * extra)
        self._views = None
