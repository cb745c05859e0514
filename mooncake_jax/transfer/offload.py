"""Layer-wise prefill: prefix KV written into the device layer by layer, new KV stored to host layer by layer,
overlapping the compute (Mooncake's layer-wise prefill), on top of the engine's layer hooks.

The engine runs the prompt layer by layer in whatever layout it has (single device, tensor parallel, CPP stages,
both) and calls the hooks of ``model.layer_hooks`` between layers:

    before layer l:  its prefix KV (host blocks of the prompt's leading cached blocks) into the layer's pages
                     (the host -> device copy of layer l is dispatched while layer l - 1 computes)
    after layer l:   its new KV starts to the host (``device_put`` to ``pinned_host`` where the backend has it,
                     ``copy_to_host_async`` elsewhere); nothing waits for it until the prefill is done
    at the end:      the stored layers are assembled into whole blocks for the caller

so prefill time approaches max(load, compute, store) instead of their sum, and nothing stands between two layers
but the dispatch of their copies. ``SERIALIZED`` mode does the same work without overlap (write every prefix block,
run the ordinary scanned prefill, then read the new blocks) for comparison; both give the same tokens, logits and
blocks as the plain engine.

No pool I/O happens here: the caller reads the prefix blocks (``pool_prefix``) and stores the returned new blocks,
on whatever thread it likes.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from ..blocks import BlockKey, block_keys, num_blocks, tail_key
from ..model.engine import Engine
from ..model.sequence import Sequence
from .pool import page_aligned_empty

LAYERWISE, SERIALIZED = "layerwise", "serialized"


def request_keys(seq: Sequence, block_size: int) -> list[BlockKey]:
    """Keys of every block of the prompt: full blocks, then the partial tail block if any."""
    keys = block_keys(seq.prompt, block_size)
    tail = tail_key(seq.prompt, block_size)
    return keys + ([tail] if tail is not None else [])


def usable_prefix_blocks(seq: Sequence, block_size: int) -> int:
    """Most leading blocks a prefill can take as cached: full blocks, leaving at least the last prompt token to
    compute (its logits give the first output token)."""
    return (len(seq.prompt) - 1) // block_size


def pool_prefix(pool, seq: Sequence, block_size: int) -> np.ndarray | None:
    """The prompt's leading blocks that ``pool`` (a ``BlockPool``) holds, as one host array [n, *block_shape], or
    None; stops at the first block the pool lost between the lookup and the read."""
    keys = request_keys(seq, block_size)[: usable_prefix_blocks(seq, block_size)]
    usable = pool.prefix_len(keys)
    stacked = page_aligned_empty((usable, *pool.spec.shape), pool.spec.dtype)  # the blocks land here, read in place
    with pool.pin(keys[:usable]):
        blocks = pool.get_many(keys[:usable], out=stacked)
    good = next((i for i, block in enumerate(blocks) if block is None), len(blocks))
    return stacked[:good] if good else None


@functools.cache
def _has_pinned_host(device) -> bool:
    return "pinned_host" in {m.kind for m in device.addressable_memories()}


def to_host_async(x: jax.Array) -> jax.Array:
    """Start copying ``x`` to host memory and return at once: ``device_put`` to the ``pinned_host`` memory kind of
    its own sharding (tensor-parallel shards stay split) where the backend has one, else ``copy_to_host_async``."""
    if all(_has_pinned_host(d) for d in x.sharding.device_set):
        return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    x.copy_to_host_async()
    return x


class _OffloadHooks:
    """Layer hooks of one prefill: prefix layers from a host array, new layers started to the host."""

    def __init__(self, prefix: np.ndarray | None):
        self.prefix = prefix  # [n, layers, 2, block_size, kv_heads, head_dim] or None
        self.saved: dict[int, jax.Array] = {}

    def wait_for_layer_load(self, layer: int) -> np.ndarray | None:
        return None if self.prefix is None else self.prefix[:, layer]

    def save_layer(self, layer: int, new_kv: jax.Array) -> None:
        self.saved[layer] = to_host_async(new_kv)

    def blocks(self, n_layers: int, n: int) -> np.ndarray:
        """The stored layers as whole blocks [n, layers, 2, block_size, kv_heads, head_dim] (waits for the copies)."""
        return np.stack([np.asarray(self.saved[layer])[:n] for layer in range(n_layers)], axis=1)


class LayerwisePrefill:
    """Prefill requests on ``engine`` (any layout) with their prefix KV handed in as host blocks."""

    def __init__(self, engine: Engine, mode: str = LAYERWISE):
        if mode not in (LAYERWISE, SERIALIZED):
            raise ValueError(f"unknown mode {mode!r}; allowed: {LAYERWISE!r}, {SERIALIZED!r}")
        self.engine, self.mode = engine, mode

    def prefill(self, seq: Sequence, prefix_blocks: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Prefill ``seq`` (not admitted yet; admitted here with fresh pages) over ``prefix_blocks``, the KV of its
        n leading prompt blocks [n, layers, 2, block_size, kv_heads, head_dim] (or None).

        Returns (last-token logits [V], new blocks): the KV of the prompt's remaining blocks, full blocks then the
        partial tail if any, as a host array in the same layout, in the order of ``request_keys(seq)[n:]``.
        """
        engine, bs = self.engine, self.engine.block_size
        n = 0
        if prefix_blocks is not None:
            prefix_blocks = np.asarray(prefix_blocks)
            n = prefix_blocks.shape[0]
            if prefix_blocks.shape[1:] != engine.cfg.block_shape():
                raise ValueError(f"prefix blocks have shape {prefix_blocks.shape}, expected "
                                 f"(n,) + {engine.cfg.block_shape()}")
            if n > usable_prefix_blocks(seq, bs):
                raise ValueError(f"{n} prefix blocks leave no prompt token to compute (the prompt has "
                                 f"{len(seq.prompt)} tokens; at most {usable_prefix_blocks(seq, bs)} blocks)")
            if n == 0:
                prefix_blocks = None
        engine.admit(seq, cached_pages=[])
        try:
            seq.cached_tokens = seq.num_computed = n * bs
            n_new = num_blocks(len(seq.prompt), bs) - n
            if self.mode == LAYERWISE:
                hooks = _OffloadHooks(prefix_blocks)
                logits = engine.prefill(seq, hooks=hooks)
                return logits, hooks.blocks(engine.cfg.n_layers, n_new)
            if prefix_blocks is not None:
                padded = engine.padded_pages(seq.pages[:n])
                data = np.zeros((len(padded),) + prefix_blocks.shape[1:], prefix_blocks.dtype)
                data[:n] = prefix_blocks  # padding rows land in the scratch page
                engine.runner.write_blocks(padded, data)
            logits = engine.prefill(seq)
            return logits, engine.read_blocks(seq.pages[n:])
        except BaseException:
            engine.release(seq)
            raise
