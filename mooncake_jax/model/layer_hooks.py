"""Layer hooks: the worker half of a KV connector (in the spirit of vLLM's ``KVConnectorBase_V1``), called by the
step runner between the layers of a prefill.

With hooks attached, every pipeline stage runs its layers one at a time (one compiled per-layer program whose layer
index is a traced argument, so single device, tensor parallel, CPP stages and both together all work the same), and
around each layer the runner calls:

- ``wait_for_layer_load(layer)`` before the layer's first chunk runs: the prefix KV of that layer, as host (or
  device) blocks [n, 2, block_size, kv_heads, head_dim] for the sequence's n leading prefix pages, which the runner
  writes into the layer's pages; or None when nothing is to be loaded (the prefix is already on the device).
  A connector that streams from elsewhere blocks here until its layer has arrived, while earlier layers compute.
- ``save_layer(layer, new_kv)`` after the layer's last chunk ran: a device array [n_padded, 2, block_size, kv_heads,
  head_dim] of the blocks this prefill wrote (its first ``len(pages written)`` rows are real, the rest padding).
  The hook must only *start* the copy (``jax.device_put`` to ``pinned_host``, or ``copy_to_host_async``) and return;
  nothing in the runner waits for it.

``layer`` is the model's global layer index (0 .. n_layers - 1), whatever stage runs it.
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np


class LayerHooks(Protocol):
    def wait_for_layer_load(self, layer: int) -> np.ndarray | jax.Array | None:
        ...

    def save_layer(self, layer: int, new_kv: jax.Array) -> None:
        ...
