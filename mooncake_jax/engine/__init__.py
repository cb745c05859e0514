"""The engine layer (DESIGN.md section 6): what sits between the model's pure steps and the instances.

- ``kv_manager.KVCacheManager``: the pages of one engine's KV cache (who holds which, what is promised to
  admitted sequences, which prompt blocks are cached for reuse).
- ``scheduler.Scheduler``: admission (max batch, pages, reservations), the waiting and running sets, refusals,
  and the bounded queue every request of an engine goes through.
- ``runner_loop.RunnerLoop``: the one compute thread that dispatches an engine's JAX work, driven by the scheduler.
- ``transfer_workers.TransferWorkers``: the bounded thread pool for pool / SSD / Messenger I/O, off the compute
  thread.

Submodules are imported directly (``from mooncake_jax.engine.scheduler import Scheduler``); this package imports
nothing eagerly, because ``model/engine.py`` (which moves here later) uses the KV-cache manager.
"""
