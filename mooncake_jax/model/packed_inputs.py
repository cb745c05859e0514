"""A step's host inputs as one host-to-device copy.

A decode step hands the device some twenty small host arrays: tokens, positions, the page table, context lengths,
write slots, logits rows and a dozen per-row sampling settings. On a GPU each becomes its own host-to-device copy that
the stream waits for (an H200 trace of a ``llama2-70b``-shaped decode step of 8 layers, batch 1: 12.9 ms a step, of
which the device's own kernels took about 4 ms and the copies and their host callbacks several; docs/benchmarks/
engine.md, twenty-third session). ``pack`` lays every 4-byte numpy leaf of the inputs (int32, uint32, float32; bool
widened) end to end in one uint32 buffer on the host; ``unpack``, inside the jitted step, cuts them back out by the
static ``Packing``. Leaves that are device arrays already (the previous stage's hidden states) pass through as they
are, and None subtrees stay None.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np

PACKED_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32), np.dtype(np.bool_))


class Slot(NamedTuple):
    """Where one leaf is: ``offset`` into the buffer (packed) or index among the passed-through arrays."""

    packed: bool
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype | None


class Packing(NamedTuple):
    """The static half of a packed tree (a jit static argument: hashable, equal for equal layouts)."""

    treedef: Any
    slots: tuple[Slot, ...]


def pack(tree) -> tuple[np.ndarray, tuple, Packing]:
    """(buffer, passed-through leaves, packing) of ``tree``: its numpy leaves of ``PACKED_DTYPES`` in one uint32
    buffer, every other leaf (a jax.Array) passed through."""
    leaves, treedef = jax.tree.flatten(tree)
    slots, parts, passed, offset = [], [], [], 0
    for leaf in leaves:
        if isinstance(leaf, (np.ndarray, np.generic)) and leaf.dtype in PACKED_DTYPES:
            flat = np.ascontiguousarray(leaf).reshape(-1)
            parts.append(flat.astype(np.uint32) if flat.dtype == np.bool_ else flat.view(np.uint32))
            slots.append(Slot(True, offset, leaf.shape, leaf.dtype))
            offset += flat.size
        else:
            slots.append(Slot(False, len(passed), (), None))
            passed.append(leaf)
    buffer = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    return buffer, tuple(passed), Packing(treedef, tuple(slots))


def unpack(buffer: jax.Array, passed: tuple, packing: Packing):
    """The tree ``pack`` was given (traced inside jit: static slices of ``buffer``, bitcast back to each dtype)."""
    leaves = []
    for slot in packing.slots:
        if not slot.packed:
            leaves.append(passed[slot.offset])
            continue
        x = buffer[slot.offset: slot.offset + math.prod(slot.shape)].reshape(slot.shape)
        if slot.dtype == np.bool_:
            x = x != 0
        elif slot.dtype != np.uint32:
            x = jax.lax.bitcast_convert_type(x, slot.dtype)
        leaves.append(x)
    return jax.tree.unflatten(packing.treedef, leaves)
