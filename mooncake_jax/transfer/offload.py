"""Layer-wise prefill: prefix KV loaded from the host pool and new KV stored to it, layer by layer, overlapping
the compute (Mooncake's layer-wise prefill).

Around the engine's per-layer prefill (an engine laid out with one stage per layer, ``per_layer_layout``):

    for layer l:  start loading layer l+1's prefix KV host -> device        (asynchronous)
                  write layer l's prefix KV (loaded during layer l-1) into its pages
                  run every chunk of the prompt through layer l
                  start storing layer l's new KV device -> host           (asynchronous, not waited for)
    at the end:   wait for all stores, assemble whole blocks, put them in the pool

so prefill time approaches max(load, compute, store) instead of their sum, and the device holds the prefix KV of one
layer at a time on its way in. ``serialized`` mode does the same work without overlap (load everything, compute,
then read and store everything) for comparison; both give the same tokens, logits and stored blocks as the plain
engine.

Host memory: where the device has a ``pinned_host`` memory kind (CPU, GPU), stores go to it with ``device_put``;
elsewhere ``copy_to_host_async`` starts the copy. Either way nothing waits until the end.
"""

from __future__ import annotations

import jax
import numpy as np

from ..blocks import BlockKey, block_keys, tail_key
from ..model.engine import Engine
from ..model.sequence import Sequence
from ..model.steps import read_blocks, write_blocks
from ..sharding.layout import SingleDevice
from .pool import BlockPool

LAYERWISE, SERIALIZED = "layerwise", "serialized"


class PerLayer(SingleDevice):
    """All layers on the default device, one stage each, so a prefill can stop between layers."""

    def __init__(self, cfg):
        self.stage_ranges = [(layer, layer + 1) for layer in range(cfg.n_layers)]


def _host_sharding():
    device = jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" in kinds:
        return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
    return None


def _to_host_async(x: jax.Array, sharding):
    if sharding is not None:
        return jax.device_put(x, sharding)
    x.copy_to_host_async()
    return x


def request_keys(seq: Sequence, block_size: int) -> list[BlockKey]:
    """Keys of every block of the prompt: full blocks, then the partial tail block if any."""
    keys = block_keys(seq.prompt, block_size)
    tail = tail_key(seq.prompt, block_size)
    return keys + ([tail] if tail is not None else [])


class LayerwisePrefill:
    """Prefill requests on ``engine`` (which must use ``PerLayer``) with their prefix KV in ``pool``."""

    def __init__(self, engine: Engine, pool: BlockPool, mode: str = LAYERWISE):
        if not isinstance(engine.layout, PerLayer):
            raise ValueError("layer-wise prefill needs an engine built with layout=PerLayer(cfg)")
        if mode not in (LAYERWISE, SERIALIZED):
            raise ValueError(f"unknown mode {mode!r}; allowed: {LAYERWISE!r}, {SERIALIZED!r}")
        if tuple(pool.spec.shape) != engine.cfg.block_shape():
            raise ValueError(f"pool blocks {tuple(pool.spec.shape)} do not match the engine's {engine.cfg.block_shape()}")
        self.engine, self.pool, self.mode = engine, pool, mode
        self._host = _host_sharding()

    def prefill(self, seq: Sequence) -> tuple[np.ndarray, list[BlockKey]]:
        """Prefill ``seq`` reusing the leading prompt blocks the pool holds; store the prompt's other blocks
        (and the partial tail) in the pool. Returns (last-token logits, keys of the blocks stored).

        ``seq`` must not be admitted yet; it is admitted here with fresh pages for the prefix it loads.
        """
        engine, bs = self.engine, self.engine.block_size
        keys = request_keys(seq, bs)
        n_full = len(seq.prompt) // bs
        usable = min(self.pool.prefix_len(keys[:n_full]), (len(seq.prompt) - 1) // bs)
        with self.pool.pin(keys[:usable]):
            prefix = self.pool.get_many(keys[:usable])
        if any(block is None for block in prefix):  # lost to damage between the lookup and the read
            usable = next(i for i, block in enumerate(prefix) if block is None)
        engine.admit(seq, cached_pages=[])
        seq.cached_tokens = seq.num_computed = usable * bs
        # Page counts padded to buckets (the padding rows go to the scratch page): a few programs, not one per size.
        prefix_pages = engine.padded_pages(seq.pages[:usable])
        new_pages = engine.padded_pages(seq.pages[usable:])
        if usable:
            prefix = np.concatenate([np.stack(prefix[:usable]), np.zeros(
                (len(prefix_pages) - usable,) + engine.cfg.block_shape(), prefix[0].dtype)])
        else:
            prefix = None
        run = self._layerwise if self.mode == LAYERWISE else self._serialized
        stored = {}
        logits = engine.prefill(seq, execute=lambda steps: run(steps, prefix, prefix_pages, new_pages, stored))
        blocks = np.concatenate([np.asarray(stored[layer]) for layer in range(engine.cfg.n_layers)], axis=1)
        new_keys = keys[usable:]
        self.pool.put_many(new_keys, blocks[: len(new_keys)])
        return logits, new_keys

    def _layerwise(self, steps, prefix, prefix_pages, new_pages, stored):
        stages = self.engine.runner.stages
        outputs: list = [None] * len(steps)
        incoming = jax.device_put(prefix[:, 0]) if prefix is not None else None
        for layer, stage in enumerate(stages):
            current = incoming
            if prefix is not None and layer + 1 < len(stages):
                incoming = jax.device_put(prefix[:, layer + 1])  # next layer's prefix, while this one computes
            if current is not None:
                stage.kv = write_blocks(stage.kv, prefix_pages, current[:, None])
            for c, step in enumerate(steps):
                inputs = step.tokens if layer == 0 else outputs[c][1]
                outputs[c] = stage(inputs, step)
            stored[layer] = _to_host_async(read_blocks(stage.kv, new_pages), self._host)
        return outputs

    def _serialized(self, steps, prefix, prefix_pages, new_pages, stored):
        runner = self.engine.runner
        if prefix is not None:
            runner.write_blocks(prefix_pages, jax.block_until_ready(jax.device_put(prefix)))
        outputs = runner.run(steps)
        jax.block_until_ready(outputs[-1][1])
        for layer, stage in enumerate(runner.stages):
            stored[layer] = np.asarray(read_blocks(stage.kv, new_pages))
        return outputs
