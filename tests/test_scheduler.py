"""The scheduler and the KV-cache manager: limits, refusals, page accounting, prefix reuse, bounded queues, and the
coupled backend over them; outputs checked against the float64 reference or against mj.LLM."""

import threading
import time

import numpy as np
import pytest

import mooncake_jax as mj
from mooncake_jax.engine.kv_manager import KVCacheManager
from mooncake_jax.instance.config import InstanceConfig
from mooncake_jax.engine.scheduler import BatchFull, QueueFull, Scheduler
from mooncake_jax.model.engine import Engine
from mooncake_jax.model.kv_cache import OutOfPages
from mooncake_jax.model.sequence import SamplingParams, Sequence
from reference_model import random_prompts as prompts, reference_greedy


def run(sched):
    while sched.has_work:
        sched.step()
        sched.kv.check(sched.running)


# ---- limits and refusals --------------------------------------------------------------------------------------------
def test_max_batch_is_never_exceeded_and_the_rest_wait(llm, ref):
    engine = Engine(llm.model, prefill_chunk_size=64, max_batch=2)
    sched = Scheduler(engine)
    ps = prompts([5, 9, 14], seed=1)
    seqs = [engine.new_sequence(p, SamplingParams(max_new_tokens=n)) for p, n in zip(ps, (3, 6, 4))]
    futures = [sched.add_request(s) for s in seqs]
    sched.step()
    assert len(sched.running) == 2 and sched.num_waiting == 1 and not futures[2].done()
    widths = []
    while sched.has_work:
        widths.append(len(sched.running))
        sched.step()
    assert max(widths) == 2
    for seq, n in zip(seqs, (3, 6, 4)):
        assert seq.output == reference_greedy(ref, seq.prompt, n)
    assert engine.pages_in_use == 0 and engine.kv.reserved == 0


def test_full_batch_refuses_work_that_must_not_wait(llm):
    engine = Engine(llm.model, prefill_chunk_size=64, max_batch=1)
    sched = Scheduler(engine)
    (a, b) = [engine.new_sequence(p, SamplingParams(max_new_tokens=8)) for p in prompts([6, 6], seed=2)]
    sched.add_request(a)
    sched.step()
    refused = sched.submit(lambda eng: pytest.fail("must not run"), joins_batch=True, wait_for_room=False)
    other = sched.submit(lambda eng: "ran")  # a job that takes no batch slot passes
    sched.step()
    with pytest.raises(BatchFull, match="batch is full"):
        refused.result(0)
    assert other.result(0) == "ran"
    engine.admit(b)
    engine.prefill(b)
    with pytest.raises(BatchFull):  # join itself refuses a sequence beyond max_batch
        sched.join(b)
    engine.release(b)
    run(sched)


def test_join_budget_spreads_a_burst_of_queued_work_over_steps(llm, ref):
    """While a sequence runs, queued work between two steps stops once it took join_budget_steps mean steps (at
    least one item each step, in order), so a burst of joins stalls the running sequence one at a time; with no
    budget, or nothing running, everything queued starts before the step."""
    for budget, per_step in ((0.0, [1, 1, 1]), (None, [3])):
        engine = Engine(llm.model, prefill_chunk_size=64, max_batch=4)
        sched = Scheduler(engine, join_budget_steps=budget)
        idle = [sched.submit(lambda eng, i=i: i) for i in range(3)]
        sched.step()  # nothing runs yet: no stall to bound
        assert [f.result(0) for f in idle] == [0, 1, 2]
        (seq,) = [engine.new_sequence(p, SamplingParams(max_new_tokens=8)) for p in prompts([7], seed=9)]
        sched.add_request(seq)
        sched.step()
        ran: list[int] = []
        jobs = [sched.submit(lambda eng, i=i: (time.sleep(0.01), ran.append(i))) for i in range(3)]
        counts = []
        while not all(j.done() for j in jobs):
            before = len(ran)
            sched.step()
            counts.append(len(ran) - before)
        assert counts == per_step and ran == [0, 1, 2]
        run(sched)
        assert seq.output == reference_greedy(ref, seq.prompt, 8)


def test_bounded_queue_overflow_is_a_clear_error(llm):
    engine = Engine(llm.model, prefill_chunk_size=64, max_batch=1)
    sched = Scheduler(engine, max_waiting=2)
    seqs = [engine.new_sequence(p, SamplingParams(max_new_tokens=2)) for p in prompts([4, 4, 4], seed=3)]
    sched.add_request(seqs[0])
    sched.add_request(seqs[1])
    with pytest.raises(QueueFull, match="queue is full"):
        sched.add_request(seqs[2])
    with pytest.raises(QueueFull):
        sched.submit(lambda eng: None)
    run(sched)
    assert all(s.finish_reason == "length" for s in seqs[:2])
    sched.add_request(seqs[2])  # room again once the queue drained
    run(sched)
    assert seqs[2].finish_reason == "length"


def test_page_exhaustion_waits_while_pages_will_free_and_refuses_otherwise(llm, ref):
    # 6 usable pages of 16 tokens. A: 40-token prompt + 20 new = 60 tokens -> 3 prompt pages + 1 reserved.
    engine = Engine(llm.model, prefill_chunk_size=64, max_batch=4, num_pages=7, prefix_caching=False)
    sched = Scheduler(engine)
    pa, pb = prompts([40, 40], seed=4)
    a = engine.new_sequence(pa, SamplingParams(max_new_tokens=20))
    b = engine.new_sequence(pb, SamplingParams(max_new_tokens=20))
    c = engine.new_sequence(pb, SamplingParams(max_new_tokens=20))
    sched.add_request(a)
    fb = sched.add_request(b)
    sched.step()
    assert sched.running == [a] and len(a.pages) == 3 and a.reserved_pages == 1
    assert engine.kv.reserved == 1 and engine.free_pages == 6 - 3 - 1  # B (4 pages) does not fit into 2: waits
    assert not fb.done() and sched.num_waiting == 1
    fc = sched.add_request(c, wait_for_room=False)  # must not wait: refused at once, holding nothing
    sched.step()
    with pytest.raises(OutOfPages):
        fc.result(0)
    assert c.pages == [] and c.reserved_pages == 0
    run(sched)
    assert fb.result(0) is b
    assert a.output == reference_greedy(ref, pa, 20) and b.output == reference_greedy(ref, pb, 20)
    assert engine.free_pages == 6 and engine.pages_in_use == 0


def test_prefix_reuse_through_the_scheduler(llm, ref):
    engine = Engine(llm.model, prefill_chunk_size=64, max_batch=4)
    sched = Scheduler(engine)
    (base,) = prompts([60], seed=5)
    first = engine.new_sequence(base, SamplingParams(max_new_tokens=2))
    sched.add_request(first)
    run(sched)
    second_prompt = base[:50] + prompts([9], seed=6)[0]
    second = engine.new_sequence(second_prompt, SamplingParams(max_new_tokens=5))
    sched.add_request(second)
    run(sched)
    assert second.cached_tokens == 48  # three full blocks reused, only 11 tokens computed
    assert second.output == reference_greedy(ref, second_prompt, 5)


def test_page_accounting_brute_force():
    """Random admissions (with prefix reuse), growth, prefill-caching and releases on the manager alone, every
    step recounted from scratch by this test: reference counts, the free list, the reservations, and that every
    admitted sequence can still grow to its full length (the reservation promise)."""
    rng = np.random.default_rng(0)
    bs, n_pages = 4, 24
    kv = KVCacheManager(n_pages, bs)
    shared = rng.integers(0, 50, 12).tolist()
    live: list[Sequence] = []

    def recount():
        refs = np.zeros(n_pages, int)
        for s in live:
            assert len(set(s.pages)) == len(s.pages)
            refs[s.pages] += 1
        cached = {kv.prefix_cache.page_of(k) for k in kv.prefix_cache.keys()}
        refs[list(cached)] += 1
        for p in range(1, n_pages):
            assert kv.allocator.refcount(p) == refs[p]
        assert kv.allocator.num_free == int((refs[1:] == 0).sum())
        assert kv.reserved == sum(s.reserved_pages for s in live)
        for s in live:  # a page two sequences hold is a cached prefix page
            for p in s.pages:
                assert refs[p] == 1 or p in cached
        kv.check(live)

    for _ in range(400):
        op = rng.integers(0, 3)
        if op == 0:
            n = int(rng.integers(1, 20))
            prompt = (shared[: int(rng.integers(0, 13))] + rng.integers(0, 50, n).tolist())[:24] or [1]
            seq = Sequence(prompt, SamplingParams(max_new_tokens=int(rng.integers(1, 8))))
            before = kv.free_pages
            try:
                kv.admit(seq)
            except OutOfPages:
                assert seq.pages == [] and kv.free_pages == before
            else:
                # the prompt's computed KV becomes cacheable (what prefill does), then some decoding
                kv.grow(seq, len(seq.prompt))
                kv.cache_prompt(seq)
                kv.grow(seq, len(seq.prompt) + int(rng.integers(0, seq.params.max_new_tokens + 1)))
                live.append(seq)
        elif op == 1 and live:
            s = live[int(rng.integers(0, len(live)))]
            kv.grow(s, min(s.max_len, len(s.pages) * bs + 1))
        elif op == 2 and live:
            kv.release(live.pop(int(rng.integers(0, len(live)))))
        recount()
    for s in live:  # every promise holds: growing to max_len never runs out
        kv.grow(s, s.max_len)
        assert s.reserved_pages == 0
    recount()
    for s in live:
        kv.release(s)
    live.clear()
    recount()
    assert kv.pages_in_use == 0 and kv.reserved == 0


def llm_over(llm, max_waiting=64, **engine_kw):
    """An mj.LLM with its own engine limits over ``llm``'s model (compiled once for the module)."""
    other = mj.LLM.__new__(mj.LLM)
    other.model, other.config = llm.model, llm.config
    other.engine = Engine(llm.model, prefill_chunk_size=64, **engine_kw)
    other.scheduler = Scheduler(other.engine, max_waiting=max_waiting)
    return other


def test_generate_equals_reference_through_a_small_queue(llm, ref):
    small = llm_over(llm, max_waiting=1, max_batch=2)
    ps = prompts([3, 11, 20, 7, 5], seed=7)
    assert small.generate(ps, max_new_tokens=6) == [reference_greedy(ref, p, 6) for p in ps]
    assert small.engine.pages_in_use == 0


# ---- warm-up ------------------------------------------------------------------------------------------------------
def test_warmup_compiles_every_sampling_mode():
    from mooncake_jax.model.config import get_config
    from mooncake_jax.model.llama import init_model
    from mooncake_jax.model.steps import forward_step, read_blocks, write_blocks

    model = init_model(get_config("tiny").replace(max_seq_len=32), 0)
    engine = Engine(model, prefill_chunk_size=16, max_batch=2)
    from mooncake_jax.model.engine import _prompt_rows, _sample_rows

    run_steps, seen = engine.runner.run, []
    engine.runner.run = lambda steps: seen.extend(steps) or run_steps(steps)
    n = engine.warmup()
    engine.runner.run = run_steps
    # every warmed step with a context table attends over all of it: with a zero context the decode attention's
    # loop over context chunks is never entered, and XLA:CPU prepares its body on the first request instead
    widths = [(s.batch.page_table.shape[1], s.batch.ctx_len.tolist()) for s in seen]
    assert {w for w, _ in widths} == {0, engine.max_pages_per_seq}  # one context width (xla attention)
    # (one token short of whole pages, so decode's tail loop of short chunks is entered as well as its whole chunks)
    assert all(ctx == [w * engine.block_size - 1] * len(ctx) for w, ctx in widths if w)
    # chunk 16 x context 0/2 pages + batch 1/2 x width 2: one program each; block moves of 1 and 2 pages;
    # every-position prefill (prompt logprobs) of chunk 16 x context 0/2, its log-softmax and last-row sampling
    assert n == 1 * 2 + 2 * 1 + 2 * 2 + 1 * 2 + 1 + 1
    compiled = forward_step._cache_size(), _prompt_rows._cache_size(), _sample_rows._cache_size()
    moves = read_blocks._cache_size(), write_blocks._cache_size()
    sched = Scheduler(engine)
    for kw in (dict(temperature=0.0), dict(temperature=0.8, seed=3), dict(temperature=0.8, top_p=0.9),
               dict(temperature=0.8, prompt_logprobs=2, logprobs=2)):  # echo with logprobs, as harnesses score
        seqs = [engine.new_sequence(p, SamplingParams(max_new_tokens=8, **kw)) for p in prompts([5, 12], seed=8)]
        for s in seqs:
            sched.add_request(s)
        run(sched)
        for n_blocks in (1, 2):  # what a prefill instance stores and a decode instance loads
            keys = [1000 * n_blocks + i for i in range(n_blocks)]
            engine.load_blocks(keys, engine.read_blocks([0] * n_blocks))  # scratch page contents: any KV will do
    assert seqs[0].prompt_logprobs is not None  # the last requests' prompt logprobs were computed
    assert (forward_step._cache_size(), _prompt_rows._cache_size(), _sample_rows._cache_size()) == compiled
    # nothing compiled after warm-up
    assert (read_blocks._cache_size(), write_blocks._cache_size()) == moves


def test_one_sampling_program_equals_each_static_mode():
    """``ANY`` (what the engine compiles) draws what the static mode of each batch draws, and a row without top-p
    draws the same whether or not its batch holds a top-p row (the exact top_p == 1 mask)."""
    import jax.numpy as jnp

    from mooncake_jax.model.sampling import ANY, GREEDY, SAMPLE, TOP_P, SamplingInputs, batch_mode, sample

    logits = jnp.asarray(np.random.default_rng(11).normal(0, 3, (4, 512)), jnp.float32)
    for temps, top_ps in (([0, 0, 0, 0], [1, 1, 1, 1]), ([0.7, 0, 1.3, 0.9], [1, 1, 1, 1]),
                          ([0.7, 0, 1.3, 0.9], [0.5, 1, 0.9, 1])):
        inputs = SamplingInputs(jnp.asarray(temps, jnp.float32), jnp.asarray(top_ps, jnp.float32),
                                jnp.arange(4, dtype=jnp.uint32) + 5, jnp.full(4, 3, jnp.int32))
        expected = sample(logits, inputs, batch_mode(temps, top_ps))
        assert np.array_equal(sample(logits, inputs, ANY), expected)
        if batch_mode(temps, top_ps) == TOP_P:  # rows 1 and 3 use no top-p: as in a batch without top-p rows
            plain = sample(logits, inputs, SAMPLE)
            assert np.array_equal(np.asarray(expected)[[1, 3]], np.asarray(plain)[[1, 3]])
        assert np.array_equal(np.asarray(sample(logits, inputs, GREEDY)),
                              np.asarray(jnp.argmax(logits, -1)))


# ---- the coupled backend over the scheduler ------------------------------------------------------------------------
def test_coupled_backend_equals_llm_and_queues_beyond_max_batch(llm):
    from mooncake_jax.gateway.backend import Finished, GenerateRequest, Rejected
    from mooncake_jax.instance.local_backend import EngineBackend

    holder = llm_over(llm, max_batch=2)
    backend = EngineBackend(holder, timeout_s=60, max_waiting=2)
    ps = prompts([6, 13, 21], seed=9)
    results = {}

    def serve(i):
        items = list(backend.generate(GenerateRequest(prompt=ps[i], max_tokens=7, request_id=str(i))))
        results[i] = ([t.token for t in items if not isinstance(t, Finished)], items[-1])

    try:
        threads = [threading.Thread(target=serve, args=(i,)) for i in range(3)]
        threads[0].start()
        threads[1].start()
        # the third comes once the loop has taken the first two (both submitted at once may still both be queued,
        # and a third beside them would find the queue of 2 full: measured once in CI on a loaded host)
        deadline = time.monotonic() + 60
        taken = lambda: not backend.loop.queued_jobs and len(results) + len(backend.loop.running) >= 2  # noqa: E731
        while not taken() and time.monotonic() < deadline:
            time.sleep(0.005)
        threads[2].start()
        for t in threads:
            t.join(120)
        expected = llm.generate(ps, max_new_tokens=7)
        assert [results[i][0] for i in range(3)] == expected  # the third waited for a slot (max_batch 2), then ran
        assert all(results[i][1].reason == "length" for i in range(3))
        assert holder.engine.pages_in_use == 0

        # A full queue is refused (HTTP 429 at the gateway), not parked: stop the loop from taking work.
        gate, started = threading.Event(), threading.Event()
        blocker = backend.loop.submit(lambda eng: (started.set(), gate.wait(30)))
        assert started.wait(30)  # the loop thread is busy; nothing queued
        queued = [backend.loop.submit(lambda eng: None) for _ in range(2)]
        try:
            with pytest.raises(Rejected, match="queue is full"):
                next(iter(backend.generate(GenerateRequest(prompt=ps[0], max_tokens=2, request_id="x"))))
        finally:
            gate.set()
        blocker.result(30)
        for f in queued:
            f.result(30)
    finally:
        backend.close()


# ---- no I/O on the compute thread ---------------------------------------------------------------------------------
class _Abort(Exception):
    pass


class _Context:
    def abort(self, code, details):
        raise _Abort(code, details)

    def add_callback(self, callback):
        pass


class _SlowMessenger:
    """A peer whose fetch blocks until the test releases it, then stores the blocks it was asked for."""

    def __init__(self, pool, blocks_by_key):
        self.pool, self.blocks_by_key = pool, blocks_by_key
        self.started, self.release = threading.Event(), threading.Event()

    def fetch(self, keys):
        self.started.set()
        assert self.release.wait(60), "the test never released the fetch"
        self.pool.put_many(list(keys), np.stack([self.blocks_by_key[k] for k in keys]))
        return type("Result", (), {"moved": list(keys)})()


def test_decode_batch_keeps_stepping_while_another_requests_kv_is_fetched(llm):
    from types import SimpleNamespace

    from mooncake_jax.blocks import num_blocks
    from mooncake_jax.engine.runner_loop import RunnerLoop
    from mooncake_jax.engine.transfer_workers import TransferWorkers
    from mooncake_jax.instance.decode import DecodeService
    from mooncake_jax.instance.rpc import messages, sampling_message
    from mooncake_jax.transfer import BlockPool, BlockSpec
    from mooncake_jax.transfer.offload import request_keys

    source = Engine(llm.model, prefill_chunk_size=64, max_batch=2)  # stands in for the prefill instance
    engine = Engine(llm.model, prefill_chunk_size=64, max_batch=4)
    pool = BlockPool(BlockSpec(llm.config.block_shape(), engine.runner.kv[0][0].dtype), dram_blocks=64)
    (pa, pb), news = prompts([37, 21], seed=10), (120, 6)
    requests, blocks_by_key = [], {}
    for i, (prompt, n) in enumerate(zip((pa, pb), news)):
        params = SamplingParams(max_new_tokens=n)
        seq = source.new_sequence(prompt, params)
        source.admit(seq, cached_pages=[])
        source.prefill(seq)
        keys = request_keys(seq, source.block_size)
        blocks = source.read_blocks(seq.pages[: num_blocks(len(prompt), source.block_size)])
        blocks_by_key.update(zip(keys, blocks))
        if i == 0:
            pool.put_many(keys, blocks)  # A's KV arrived; B's was evicted: a Messenger fetch from its source
        requests.append(messages.DecodeRequest(request_id=str(i), prompt=prompt, sampling=sampling_message(params),
                                               first_token=seq.output[0], kv_keys=keys, kv_source="peer"))
        source.release(seq)
    peer = _SlowMessenger(pool, blocks_by_key)
    instance = SimpleNamespace(engine=engine, pool=pool, loop=RunnerLoop(engine).start(),
                               transfers=TransferWorkers(2, 8), costs=None, link=None,
                               config=SimpleNamespace(request_timeout_s=60),
                               messenger=lambda address: peer)
    service = DecodeService(instance)
    tokens = {0: [], 1: []}
    progress = threading.Condition()

    def stream(i):
        for event in service.Decode(requests[i], _Context()):
            if event.HasField("token"):
                with progress:
                    tokens[i].append(event.token.token)
                    progress.notify_all()

    try:
        a = threading.Thread(target=stream, args=(0,))
        a.start()
        with progress:
            assert progress.wait_for(lambda: tokens[0], 60)
        b = threading.Thread(target=stream, args=(1,))
        b.start()
        assert peer.started.wait(60)  # B's KV is being fetched, and is held there until released
        with progress:
            seen = len(tokens[0])
            # A's tokens keep arriving while B's fetch is stuck: the fetch is not on the engine's thread
            assert progress.wait_for(lambda: len(tokens[0]) >= seen + 5, 60), "decode stalled during the fetch"
        assert not tokens[1] and len(tokens[0]) < news[0] - 1
        peer.release.set()
        a.join(60)
        b.join(60)
        expected = llm.generate([pa, pb], max_new_tokens=120)
        assert [requests[0].first_token] + tokens[0] == expected[0]
        assert [requests[1].first_token] + tokens[1] == expected[1][:6]
        assert engine.pages_in_use == 0
    finally:
        peer.release.set()
        instance.loop.stop()
        instance.transfers.close()
        pool.close()


class _ThreadLoggingPool:
    """A pool that records which thread does each read or write."""

    def __init__(self, pool):
        self._pool, self.threads = pool, []

    def __getattr__(self, name):
        attr = getattr(self._pool, name)
        if name in ("get_many", "put_many", "get", "put"):
            def logged(*args, **kwargs):
                self.threads.append(threading.current_thread().name)
                return attr(*args, **kwargs)
            return logged
        return attr

    def __contains__(self, key):
        return key in self._pool


def test_prefill_instance_reads_and_writes_the_pool_on_transfer_threads_only(llm):
    from types import SimpleNamespace

    from mooncake_jax.engine.runner_loop import RunnerLoop
    from mooncake_jax.engine.transfer_workers import TransferWorkers
    from mooncake_jax.instance.prefill import PrefillService
    from mooncake_jax.instance.rpc import messages, sampling_message
    from mooncake_jax.transfer import BlockPool, BlockSpec

    engine = Engine(llm.model, prefill_chunk_size=64, max_batch=2)
    pool = _ThreadLoggingPool(BlockPool(BlockSpec(llm.config.block_shape(), engine.runner.kv[0][0].dtype),
                                        dram_blocks=64))
    instance = SimpleNamespace(engine=engine, pool=pool, loop=RunnerLoop(engine, name="engine-thread").start(),
                               transfers=TransferWorkers(2, 8, name="transfer"), costs=None, link=None,
                               ttft_slo_s=None, config=SimpleNamespace(request_timeout_s=60, layerwise=False),
                               kv_layout=InstanceConfig("prefill").kv_layout(engine.cfg))
    service = PrefillService(instance)
    (base,) = prompts([60], seed=12)
    second = base[:50] + prompts([9], seed=13)[0]
    params = SamplingParams(max_new_tokens=4)
    try:
        first_reply = service.Prefill(messages.PrefillRequest(request_id="a", prompt=base,
                                                              sampling=sampling_message(params)), _Context())
        assert len(pool.keys()) == 4  # three full blocks and the partial tail stored
        engine.prefix_cache.clear()  # the engine forgets: the shared prefix must come back from the pool
        reply = service.Prefill(messages.PrefillRequest(request_id="b", prompt=second,
                                                        sampling=sampling_message(params)), _Context())
        assert reply.cached_tokens == 48
        assert [first_reply.first_token, reply.first_token] == [o[0] for o in llm.generate([base, second], 1)]
        assert pool.threads and all(name.startswith("transfer") for name in pool.threads), pool.threads
        assert engine.pages_in_use == 0
    finally:
        instance.loop.stop()
        instance.transfers.close()
        pool.close()


def test_full_queues_and_batches_are_resource_exhausted_at_an_instance():
    import grpc

    from mooncake_jax.engine.transfer_workers import TransferWorkers
    from mooncake_jax.instance.rpc import status_of

    assert status_of(QueueFull("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED  # the cluster backend: Rejected, 429
    assert status_of(BatchFull("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    workers = TransferWorkers(1, 2)
    gate = threading.Event()
    try:
        held = [workers.submit(gate.wait, 30) for _ in range(2)]
        with pytest.raises(QueueFull, match="transfer queue is full"):
            workers.submit(gate.wait, 30)
        gate.set()
        assert all(f.result(30) for f in held)
        for _ in range(500):  # the slots come back as the tasks' done-callbacks run
            try:
                assert workers.submit(lambda: "room again").result(30) == "room again"
                break
            except QueueFull:
                time.sleep(0.01)
        else:
            pytest.fail("the transfer queue never had room again")
    finally:
        gate.set()
        workers.close()
