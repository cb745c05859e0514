"""The block index's table operations, compiled with numba where it is installed (``FlatBlockIndex``).

Why: with the decode and prefill choices compiled (``kernels.py``), the dict ``BlockIndex`` was the largest part of a
decision: recording ~17 expected keys in a 10^6-key dict, the slot's key set and its expected times, and the prefix
walk's lookups, each a few cache misses through a dict's index, its entries and the key objects. A flat table walked
by compiled code costs one or two cache lines a key and no Python step per key. (The same table in pure numpy was
tried and was slower than the dict: ~10 numpy calls of fixed cost per request; docs/benchmarks/conductor.md,
sixth pass.)

The table is one ``uint64`` array of ``capacity + 1`` rows: column 0 the key, then ``width`` words of the holding
slots' bit mask, then ``width`` words of the subset holding it on SSD. Open addressing with linear probing from a
mixed hash of the key; exact (keys compared in full, a hash table and not a filter); an empty row holds
``EMPTY`` (2^64 - 1) as its key, so the one real key of that value lives in the spare last row, whose mask says
whether anyone holds it. A row whose mask becomes zero is deleted by backward shifting (no tombstones): a lookup
stops at the first empty row.

The expected blocks (``BlockIndex.expect``: a block a routed request will leave on a slot, with the time it lands)
are a second table of the same kind, keyed by (key, slot): rows of key and slot + 1 (0: empty), and a parallel
array of ready times. ``expect`` records them in the same pass that sets the holder bits, ``store`` (a KV event
confirming them) and ``remove`` forget them in theirs, so an accepted request's blocks cost no Python step each.

Book-keeping shared with the Python side: ``stats`` = [keys held, expectations kept, the key table's load bound,
the expectations' load bound]; ``counts[0, slot]`` keys a slot holds, ``counts[1, slot]`` keys expected there;
``latest[slot]`` the latest ready time ever expected there (since a purge). A kernel that would pass a load bound
changes nothing and says so (-1 / False): the caller grows the table and calls again.

These functions take and return arrays and numbers only; ``compiled()`` gives them compiled, or None (the dict
index then answers the same).
"""

from __future__ import annotations

import functools
import logging

import numpy as np

from mooncake_jax.conductor import kernels

EMPTY = np.uint64(0xFFFFFFFFFFFFFFFF)
_ZERO, _ONE = np.uint64(0), np.uint64(1)
_S3, _S33, _L7 = np.uint64(3), np.uint64(33), np.uint64(7)
_MP = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)


def _home(key, capmask):
    """The row a key's probe starts at: the key's group of eight (``key >> 3``) mixed (murmur3's finaliser), its
    place in the group kept (``key & 7``), cut to the table's size (a power of two).

    Why groups: a prompt's keys are mostly consecutive integers in the trace (91% of successive ``hash_ids`` differ
    by 1), and a dict stores consecutive ints in consecutive places; eight consecutive keys in eight adjacent rows
    (three cache lines) keep that locality, while the groups themselves spread over the table, so runs of
    consecutive keys never pile up into one long probe run. Real block keys (blake2b digests) are uniform either
    way."""
    g = key >> _S3
    g = g ^ (g >> _S33)
    g = g * _M1
    g = g ^ (g >> _S33)
    g = g * _M2
    g = g ^ (g >> _S33)
    return np.int64(((g << _S3) | (key & _L7)) & capmask)


def _probe(table, key):
    """The row holding ``key``, else the empty row where its probe run ends (where it would go); the spare row for
    the key ``EMPTY``."""
    spare = table.shape[0] - 1
    if key == EMPTY:
        return spare
    capmask = np.uint64(spare - 1)
    i = _home(key, capmask)
    while True:
        k = table[i, 0]
        if k == key or k == EMPTY:
            return i
        i = (i + 1) & (spare - 1)


def _find(table, key):
    """The row holding ``key``, or -1 (the spare row for the key ``EMPTY``, held or not)."""
    i = _probe(table, key)
    return i if i == table.shape[0] - 1 or table[i, 0] == key else -1


def _find_or_add(table, key, stats):
    """The row holding ``key``, added (zero masks) where it is absent; counts a new key in ``stats[0]`` (the spare
    row: counted when its first holder is set, by the caller)."""
    i = _probe(table, key)
    if i != table.shape[0] - 1 and table[i, 0] == EMPTY:
        table[i, 0] = key
        stats[0] += 1
    return i


def _delete(table, i):
    """Empty row ``i`` (its masks zero already) and shift back the rows of its probe run that would no longer be
    found past the gap (linear probing's deletion: lookups stop at the first empty row, so no tombstones)."""
    spare = table.shape[0] - 1
    if i == spare:
        return
    last = spare - 1
    capmask = np.uint64(last)
    j = i
    while True:
        j = (j + 1) & last
        k = table[j, 0]
        if k == EMPTY:
            break
        h = _home(k, capmask)
        # the row at j stays where it is when its home lies cyclically in (i, j]
        if (i < j and i < h <= j) or (j < i and (h > i or h <= j)):
            continue
        table[i, :] = table[j, :]
        i = j
    table[i, 0] = EMPTY
    table[i, 1:] = _ZERO


def _held(table, row, width):
    for w in range(width):
        if table[row, 1 + w] != _ZERO:
            return True
    return False


def _room(table, slot, adding, expecting, stats):
    """Whether ``slot`` has a word in the masks, and ``adding`` more keys and ``expecting`` more expectations stay
    within the two tables' load bounds (``stats[2]``, ``stats[3]``)."""
    return (0 <= slot < 32 * (table.shape[1] - 1) and stats[0] + adding <= stats[2]
            and stats[1] + expecting <= stats[3])


# ------------------------------------------------------------------------------ expected blocks: (key, slot) -> time

def _phome(key, s1, capmask):
    """An expectation's home row: its key combined with its slot (+1) (a constant per slot: a slot's consecutive keys
    keep their groups of eight)."""
    return _home(key ^ (s1 * _MP), capmask)


def _pfind(pend, key, s1):
    """The row of the expectation (``key``, slot ``s1 - 1``), or -1. Column 1 holds slot + 1: 0 marks an empty row."""
    last = pend.shape[0] - 1
    i = _phome(key, s1, np.uint64(last))
    while True:
        if pend[i, 1] == _ZERO:
            return -1
        if pend[i, 0] == key and pend[i, 1] == s1:
            return i
        i = (i + 1) & last


def _padd(pend, ptime, key, s1, ready_at):
    """Record (or move) an expectation; returns whether it is new."""
    last = pend.shape[0] - 1
    i = _phome(key, s1, np.uint64(last))
    while pend[i, 1] != _ZERO:
        if pend[i, 0] == key and pend[i, 1] == s1:
            ptime[i] = ready_at
            return False
        i = (i + 1) & last
    pend[i, 0], pend[i, 1], ptime[i] = key, s1, ready_at
    return True


def _pdelete(pend, ptime, i):
    """``_delete`` for the expectations' table."""
    last = pend.shape[0] - 1
    capmask = np.uint64(last)
    j = i
    while True:
        j = (j + 1) & last
        if pend[j, 1] == _ZERO:
            break
        h = _phome(pend[j, 0], pend[j, 1], capmask)
        if (i < j and i < h <= j) or (j < i and (h > i or h <= j)):
            continue
        pend[i, 0], pend[i, 1], ptime[i] = pend[j, 0], pend[j, 1], ptime[j]
        i = j
    pend[i, 0], pend[i, 1] = _ZERO, _ZERO


def _pdrop(pend, ptime, key, slot, counts, stats):
    """Forget the expectation (``key``, ``slot``) if there is one (confirmed, or the block gone)."""
    if counts[1, slot] == 0:
        return
    i = _pfind(pend, key, np.uint64(slot + 1))
    if i >= 0:
        _pdelete(pend, ptime, i)
        counts[1, slot] -= 1
        stats[1] -= 1


# ------------------------------------------------------------------------------------------------- operations

def match_levels(table, keys, out):
    """The prefix walk (``BlockIndex.match_levels``): writes levels as rows of ``out`` (length, then the mask's
    words), returns how many."""
    width = (table.shape[1] - 1) // 2
    n = keys.shape[0]
    if n == 0:
        return 0
    running = np.zeros(width, np.uint64)
    row = _find(table, keys[0])
    alive = False
    if row >= 0:
        for w in range(width):
            running[w] = table[row, 1 + w]
            if running[w] != _ZERO:
                alive = True
    levels = 0
    i = 1
    while alive and i < n:
        row = _find(table, keys[i])
        changed = False
        alive = False
        for w in range(width):
            still = running[w] & table[row, 1 + w] if row >= 0 else _ZERO
            if still != running[w]:
                changed = True
            if still != _ZERO:
                alive = True
        if changed:
            out[levels, 0] = np.uint64(i)
            for w in range(width):
                still = running[w] & table[row, 1 + w] if row >= 0 else _ZERO
                out[levels, 1 + w] = running[w] & ~still
                running[w] = still
            levels += 1
        i += 1
    if alive:
        out[levels, 0] = np.uint64(n)
        for w in range(width):
            out[levels, 1 + w] = running[w]
        levels += 1
    return levels


def expect(table, keys, first, slot, ready_at, counts, latest, stats, pend, ptime):
    """``slot`` will hold ``keys[first:]`` from ``ready_at`` on: sets its bit where it lacks it and records those keys
    as expected then (each once); returns how many; -1, changing nothing, when a table needs room first (``_room``).
    ``counts``: per slot, keys held (row 0) and expected (row 1); ``latest``: per slot, the latest ready time ever
    expected there (since a purge)."""
    if not _room(table, slot, keys.shape[0] - first, keys.shape[0] - first, stats):
        return -1
    width = (table.shape[1] - 1) // 2
    word, bit = 1 + (slot >> 6), _ONE << np.uint64(slot & 63)
    spare = table.shape[0] - 1
    s1 = np.uint64(slot + 1)
    new = 0
    for i in range(first, keys.shape[0]):
        key = keys[i]
        row = _find_or_add(table, key, stats)
        if table[row, word] & bit:
            continue
        if row == spare and not _held(table, row, width):
            stats[0] += 1
        table[row, word] |= bit
        counts[0, slot] += 1
        if _padd(pend, ptime, key, s1, ready_at):
            counts[1, slot] += 1
            stats[1] += 1
        new += 1
    if new and ready_at > latest[slot]:
        latest[slot] = ready_at
    return new


def store(table, keys, slot, to_ssd, counts, stats, pend, ptime):
    """``slot`` holds ``keys`` now, in DRAM or (``to_ssd``) on SSD (``BlockIndex.store``): their expectations there
    are confirmed (forgotten); False, changing nothing, when the table needs room first (``_room``)."""
    if not _room(table, slot, keys.shape[0], 0, stats):  # a store confirms expectations, adds none
        return False
    width = (table.shape[1] - 1) // 2
    word, bit = 1 + (slot >> 6), _ONE << np.uint64(slot & 63)
    spare = table.shape[0] - 1
    for i in range(keys.shape[0]):
        key = keys[i]
        row = _find_or_add(table, key, stats)
        if not table[row, word] & bit:
            if row == spare and not _held(table, row, width):
                stats[0] += 1
            table[row, word] |= bit
            counts[0, slot] += 1
        if to_ssd:
            table[row, word + width] |= bit
        else:
            table[row, word + width] &= ~bit
        _pdrop(pend, ptime, key, slot, counts, stats)
    return True


def remove(table, keys, slot, counts, stats, pend, ptime):
    """``slot`` no longer holds ``keys`` (``BlockIndex.remove``); keys it never held are ignored. Returns how many
    it held."""
    width = (table.shape[1] - 1) // 2
    if not 0 <= slot < 64 * width:
        return 0
    word, bit = 1 + (slot >> 6), _ONE << np.uint64(slot & 63)
    removed = 0
    for i in range(keys.shape[0]):
        row = _find(table, keys[i])
        if row < 0 or not table[row, word] & bit:
            continue
        table[row, word] &= ~bit
        table[row, word + width] &= ~bit
        counts[0, slot] -= 1
        removed += 1
        _pdrop(pend, ptime, keys[i], slot, counts, stats)
        if not _held(table, row, width):
            stats[0] -= 1
            _delete(table, row)
    return removed


def purge(table, slot, counts, latest, stats, pend, ptime):
    """Forget everything ``slot`` holds and expects: one pass clearing its bits, then the rows left without holders
    deleted (found again by key: deleting shifts rows, so not during the pass); the same for its expectations.
    Returns how many keys it held."""
    width = (table.shape[1] - 1) // 2
    if not 0 <= slot < 64 * width:
        return 0
    word, bit = 1 + (slot >> 6), _ONE << np.uint64(slot & 63)
    spare = table.shape[0] - 1
    emptied = np.empty(counts[0, slot], np.uint64)
    found = 0
    empty_rows = 0
    for row in range(spare + 1):
        if (row == spare or table[row, 0] != EMPTY) and table[row, word] & bit:
            table[row, word] &= ~bit
            table[row, word + width] &= ~bit
            found += 1
            if not _held(table, row, width):
                stats[0] -= 1
                if row != spare:
                    emptied[empty_rows] = table[row, 0]
                    empty_rows += 1
    for k in range(empty_rows):
        _delete(table, _find(table, emptied[k]))
    counts[0, slot] = 0
    s1 = np.uint64(slot + 1)
    expected = np.empty(counts[1, slot], np.uint64)
    n = 0
    for row in range(pend.shape[0]):
        if pend[row, 1] == s1:
            expected[n] = pend[row, 0]
            n += 1
    for k in range(n):
        _pdrop(pend, ptime, expected[k], slot, counts, stats)
    latest[slot] = -np.inf
    return found


def ready_times(pend, ptime, slot, keys, counts, out):
    """For each key, the time ``slot`` is expected to have it (-inf: it has it now or it is not expected) into
    ``out``."""
    none = slot < 0 or slot >= counts.shape[1] or counts[1, slot] == 0
    s1 = np.uint64(slot + 1)
    for k in range(keys.shape[0]):
        i = -1 if none else _pfind(pend, keys[k], s1)
        out[k] = ptime[i] if i >= 0 else -np.inf


def sweep(pend, ptime, now, counts, stats):
    """Forget every expectation due by ``now`` (landed, or as good as landed: a send waits for none of them):
    survivors gathered, the table cleared, survivors put back. Returns how many survive."""
    n = stats[1]
    keys, slots, times = np.empty(n, np.uint64), np.empty(n, np.uint64), np.empty(n)
    kept = 0
    for row in range(pend.shape[0]):
        if pend[row, 1] != _ZERO:
            if ptime[row] > now:
                keys[kept], slots[kept], times[kept] = pend[row, 0], pend[row, 1], ptime[row]
                kept += 1
            pend[row, 0], pend[row, 1] = _ZERO, _ZERO
    counts[1, :] = 0
    for k in range(kept):
        _padd(pend, ptime, keys[k], slots[k], times[k])
        counts[1, np.int64(slots[k]) - 1] += 1
    stats[1] = kept
    return kept


def find(table, key):
    """``_find`` for the Python side (``holders``, ``tier``)."""
    return _find(table, key)


def rehash(old, new):
    """Every held row of ``old`` into the empty table ``new`` (twice the rows, or as many: growth), masks as they
    are (the same width)."""
    spare, new_spare = old.shape[0] - 1, new.shape[0] - 1
    capmask = np.uint64(new_spare - 1)
    new[new_spare, :] = old[spare, :]
    for row in range(spare):
        key = old[row, 0]
        if key == EMPTY:
            continue
        i = _home(key, capmask)
        while new[i, 0] != EMPTY:
            i = (i + 1) & (new_spare - 1)
        new[i, :] = old[row, :]


def prehash(pend, ptime, new_pend, new_ptime):
    """Every expectation of ``pend`` into the empty, larger ``new_pend`` (growth)."""
    for row in range(pend.shape[0]):
        if pend[row, 1] != _ZERO:
            _padd(new_pend, new_ptime, pend[row, 0], pend[row, 1], ptime[row])


_FUNCTIONS = (match_levels, expect, store, remove, purge, find, rehash, ready_times, sweep, prehash)


class KernelNotCompiled(RuntimeError):
    """A kernel numba could not compile (``kernels._compiled`` logged why)."""


class Compiled:
    """The table operations, compiled: one attribute per function of ``_FUNCTIONS``."""

    def __init__(self, numba):
        # the helpers are compiled first and stay so in this module's globals: numba resolves a kernel's globals
        # when it compiles it (numba's cache makes a later process's compile a read)
        jit = numba.njit(cache=True)
        for name in ("_home", "_probe", "_find", "_find_or_add", "_delete", "_held", "_room", "_phome", "_pfind",
                     "_padd", "_pdelete", "_pdrop"):
            function = globals()[name]
            globals()[name] = function if hasattr(function, "py_func") else jit(function)
        table, (pend, ptime) = empty_table(4, 1), empty_expectations(4)
        keys, stats = np.array([1, 2], np.uint64), np.array([0, 0, 3, 3], np.int64)
        counts, latest = np.zeros((2, 64), np.int64), np.full(64, -np.inf)
        levels, times = np.empty((65, 2), np.uint64), np.empty(2)
        for name, example in (
                ("store", (table, keys, 0, False, counts, stats, pend, ptime)),
                ("expect", (table, keys, 0, 1, 1.0, counts, latest, stats, pend, ptime)),
                ("match_levels", (table, keys, levels)),
                ("find", (table, keys[0])),
                ("ready_times", (pend, ptime, 1, keys, counts, times)),
                ("sweep", (pend, ptime, 0.0, counts, stats)),
                ("remove", (table, keys, 0, counts, stats, pend, ptime)),
                ("purge", (table, 1, counts, latest, stats, pend, ptime)),
                ("rehash", (table, empty_table(8, 1))),
                ("prehash", (pend, ptime) + empty_expectations(8))):
            kernel = kernels._compiled(numba, globals()[name], *example)
            if kernel is None:
                raise KernelNotCompiled(name)
            setattr(self, name, kernel)


def empty_table(capacity: int, width: int) -> np.ndarray:
    """A table of ``capacity`` rows (a power of two) and the spare row, every key ``EMPTY``, every mask zero."""
    table = np.zeros((capacity + 1, 1 + 2 * width), np.uint64)
    table[:, 0] = EMPTY
    return table


def empty_expectations(capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """The expectations' table of ``capacity`` rows (a power of two): (key, slot + 1) rows, all empty, and their
    ready times."""
    return np.zeros((capacity, 2), np.uint64), np.full(capacity, -np.inf)


@functools.cache
def compiled() -> Compiled | None:
    """The compiled table operations, or None without numba (or where it cannot compile them: one log line, from
    ``kernels._compiled``); compiled (or read from numba's cache) on the first call, by calls on arrays of the real
    ones' types."""
    numba = kernels._numba()
    if numba is None:
        return None
    try:
        return Compiled(numba)
    except KernelNotCompiled:  # kernels._compiled logged why: the dict index answers the same
        return None
    except Exception as err:  # noqa: BLE001 - a helper that cannot compile: the dict index answers the same
        logging.getLogger(__name__).warning("numba could not compile the block index (%s); using the dict index", err)
        return None
