"""The gateway's per-request token handling as an incremental object (``stream.TokenFlow``): hand-worked events for
bytes of a multi-byte character and a stop string, and the same events as ``stream.run`` over the same stream."""

from __future__ import annotations

import threading
import time

from test_gateway_support import FakeBackend

from mooncake_jax.gateway.backend import GenerateRequest, TokenOut
from mooncake_jax.gateway.metrics import GatewayMetrics
from mooncake_jax.gateway.stream import Summary, TokenFlow, TokenMerge, _Text, run
from mooncake_jax.gateway.token_feed import FeedReceiver, FeedSender
from mooncake_jax.gateway.tokenizer import BYTE_OFFSET, ByteTokenizer
from mooncake_jax.gateway.validate import Prepared


def byte_tokens(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode()]


def flow(want_text: bool = True, stops=("STOP",)):
    cancelled, times = threading.Event(), []
    clock = iter(range(100))
    return TokenFlow(_Text(ByteTokenizer(), stops), want_text, times, cancelled, lambda: float(next(clock))), \
        cancelled, times


def test_each_token_is_released_when_its_text_is_decided():
    f, cancelled, times = flow()
    steps = [f.add(TokenOut(t, i, 0.0)) for i, t in enumerate(byte_tokens("aé"))]
    assert [[(e.index, e.text) for e in out] for out in steps] == [
        [(0, "a")],  # a whole character: out at once
        [],  # the first byte of "é": held, its text undecided
        [(1, ""), (2, "é")],  # the second byte decides it; the newest token carries the text
    ]
    assert f.finish() == [] and not cancelled.is_set() and times == [0.0, 1.0, 2.0]


def test_a_stop_string_ends_the_flow_and_cancels_the_request():
    f, cancelled, times = flow()
    out = [f.add(TokenOut(t, i, 0.0)) for i, t in enumerate(byte_tokens("xSTOPy"))]
    assert [[(e.index, e.text) for e in o] for o in out] == [
        [(0, "x")], [], [(1, "")], [(2, "")], [(3, ""), (4, "")], []]  # "S", "T", "O" held in turn; "y" ignored
    assert f.stopped and cancelled.is_set() and len(times) == 5  # no time for the token after the stop


def test_without_text_the_events_carry_none_but_stop_strings_still_count():
    f, cancelled, _ = flow(want_text=False)
    events = [e for i, t in enumerate(byte_tokens("abSTOP")) for e in f.add(TokenOut(t, i, 0.0))]
    assert [e.text for e in events] == [""] * 6 and f.stopped and cancelled.is_set()


def test_the_held_token_goes_out_at_the_end_with_the_rest_of_the_text():
    f, _, _ = flow()
    assert f.add(TokenOut(byte_tokens("é")[0], 0, 0.0)) == []
    assert [(e.index, e.text) for e in f.finish()] == [(0, "\ufffd")]  # a lone lead byte: the replacement character


def test_run_gives_the_events_the_flow_gives_token_by_token():
    tokens = byte_tokens("héllo STOP there")
    backend = FakeBackend()
    backend.reply = tokens
    prepared = Prepared(GenerateRequest(prompt=[5, 6, 7], max_tokens=len(tokens)), stop=("STOP",), text_prompt=True)
    events = list(run(backend, prepared, ByteTokenizer(), arrival=0.0, cancelled=threading.Event(),
                      metrics=GatewayMetrics(), api="http", want_text=True))
    assert isinstance(events[-1], Summary)
    f, _, _ = flow()
    by_hand = [e for i, t in enumerate(tokens) for e in f.add(TokenOut(t, i, 0.0))] + f.finish()
    assert [(e.token, e.index, e.text) for e in events[:-1]] == [(e.token, e.index, e.text) for e in by_hand]
    assert "".join(e.text for e in by_hand) == "héllo "


# ---- two ways for the same tokens: the merge, run with a feed, the datagrams ------------------------------------

def plain_events(tokens: list[int]) -> list[tuple]:
    f, _, _ = flow()
    events = [e for i, t in enumerate(tokens) for e in f.add(TokenOut(t, i, 0.0))] + f.finish()
    return [(e.token, e.index, e.text) for e in events]


def test_the_merge_takes_each_index_once_in_order_from_either_way():
    tokens = byte_tokens("aé STOP")
    f, _, _ = flow()
    got = []
    merge = TokenMerge(f, lambda e: got.append((e.token, e.index, e.text)))
    outs = [TokenOut(t, i, 0.0) for i, t in enumerate(tokens)]
    for i in (2, 1, 2, 0, 4, 3, 0, 6, 5, 9999):  # ahead of turn, copies, out of order, far ahead
        merge.offer(outs[min(i, len(outs) - 1)] if i < 9999 else TokenOut(1, 9999, 0.0))
    assert merge.add(outs[7]) == [] and merge.finish() == []
    assert got == plain_events(tokens)[:len(got)] and [e[1] for e in got] == list(range(len(got)))
    assert len(got) == 8  # "S", "T", "O", "P": the stop string's tokens still go out, without text


class FeedBackend(FakeBackend):
    """A backend beside a token feed: with ``early``, each token reaches the feed's sink before the stream yields it
    (the datagram won); without, the feed never brings anything (every datagram lost)."""

    def __init__(self, early: bool):
        super().__init__()
        self.early = early
        self.feed = None

    def generate(self, request, cancelled=None):
        for item in super().generate(request, cancelled):
            if self.early and isinstance(item, TokenOut) and self.feed.sinks.get(request.request_id):
                self.feed.sinks[request.request_id](TokenOut(item.token, item.index, 0.0))
            yield item


class FakeFeed:
    address = "127.0.0.1:9"

    def __init__(self):
        self.sinks = {}

    def register(self, request_id, sink):
        self.sinks[request_id] = sink

    def unregister(self, request_id):
        self.sinks.pop(request_id)


def test_run_with_a_feed_emits_the_same_events_whichever_way_wins():
    tokens = byte_tokens("héllo there")
    for early in (False, True):
        backend, feed, emitted = FeedBackend(early), FakeFeed(), []
        backend.feed, backend.reply = feed, tokens
        request = GenerateRequest(prompt=[5, 6, 7], max_tokens=len(tokens))
        out = list(run(backend, Prepared(request, stop=(), text_prompt=True), ByteTokenizer(), arrival=0.0,
                       cancelled=threading.Event(), metrics=GatewayMetrics(), api="http", want_text=True,
                       feed=feed, emit=emitted.append))
        assert len(out) == 1 and isinstance(out[0], Summary) and out[0].output_tokens == len(tokens)
        assert [(e.token, e.index, e.text) for e in emitted] == plain_events(tokens)
        assert request.token_feed == feed.address and feed.sinks == {}  # given to the backend; unregistered after


def test_datagrams_reach_the_registered_request_and_nothing_else():
    import asyncio

    receiver = FeedReceiver("127.0.0.1")
    loop = asyncio.new_event_loop()
    got = []
    try:
        receiver.attach(loop)
        receiver.register("abc", got.append)
        FeedSender(receiver.address, "abc").send(1, 300)
        FeedSender(receiver.address, "xyz").send(1, 301)  # no such request
        sender = FeedSender(receiver.address, "abc")
        sender._sock.sendto(b"garbage", sender._target)  # not a token: dropped
        sender.send(2, 302)
        deadline = loop.time() + 5
        while len(got) < 2 and loop.time() < deadline:
            loop.run_until_complete(asyncio.sleep(0.01))
        assert [(t.index, t.token) for t in got] == [(1, 300), (2, 302)] and receiver.received == 2
        receiver.unregister("abc")
        FeedSender(receiver.address, "abc").send(3, 303)
        loop.run_until_complete(asyncio.sleep(0.05))
        assert len(got) == 2
    finally:
        receiver.close(loop)
        loop.close()


class RecordingSender:
    def __init__(self):
        self.sent = []

    def send(self, index, token):
        self.sent.append((index, token))


def test_a_fed_token_stream_sends_each_token_as_put_and_is_read_in_batches():
    """``TokenStream`` with a feed: each token goes to the sender at once (index 1 onward), and the reader gets every
    token once, in order, in batches that say their first index; an error on the loop side ends them."""
    import pytest

    from mooncake_jax.engine.runner_loop import TokenStream

    sender = RecordingSender()
    stream = TokenStream(timeout_s=5.0, feed=sender)
    tokens = list(range(300, 320))

    def loop_side():
        for t in tokens:
            stream.put(t)
            time.sleep(0.002)
        stream.finish("length")

    thread = threading.Thread(target=loop_side)
    thread.start()
    batches = list(stream.batches(0.01))
    thread.join()
    assert stream.feeds and sender.sent == list(enumerate(tokens, start=1)) and stream.finish_reason == "length"
    assert [t for _, b in batches for t in b] == tokens
    assert [i for i, _ in batches] == [1 + sum(len(b) for _, b in batches[:k]) for k in range(len(batches))]

    ended = TokenStream(feed=sender)  # all put before the reader looks: one batch, at once, however long the interval
    for t in tokens[:3]:
        ended.put(t)
    ended.finish("stop")
    assert list(ended.batches(60.0)) == [(1, tokens[:3])]

    failed = TokenStream(feed=sender)
    failed.put(7)
    failed.fail(RuntimeError("engine died"))
    read = []
    with pytest.raises(RuntimeError, match="engine died"):
        for batch in failed.batches(60.0):
            read.append(batch)
    assert read == [(1, [7])]

    silent = TokenStream(timeout_s=0.05, feed=sender)  # nothing comes: the reader does not hang
    with pytest.raises(TimeoutError):
        list(silent.batches(0.01))


def test_a_feed_on_loopback_is_given_only_to_instances_on_this_machine():
    """``token_feed.reaches``: an instance elsewhere would send a loopback feed's datagrams to its own loopback (its
    tokens would then come only in the stream's batches), so such a feed is for instances on this machine; a feed
    on a routable address is for every instance."""
    from mooncake_jax.gateway.token_feed import reaches

    assert reaches("127.0.0.1:5000", "127.0.0.1:6000") and reaches("127.0.0.1:5000", "localhost:6000")
    assert reaches("[::1]:5000", "[::1]:6000")
    assert not reaches("127.0.0.1:5000", "10.1.2.3:6000") and not reaches("[::1]:5000", "[fd00::7]:6000")
    assert reaches("10.0.0.5:5000", "10.1.2.3:6000") and reaches("10.0.0.5:5000", "127.0.0.1:6000")
