"""The gateway's per-request token handling as an incremental object (``stream.TokenFlow``): hand-worked events for
bytes of a multi-byte character and a stop string, and the same events as ``stream.run`` over the same stream."""

from __future__ import annotations

import threading

from test_gateway_support import FakeBackend

from mooncake_jax.gateway.backend import GenerateRequest, TokenOut
from mooncake_jax.gateway.metrics import GatewayMetrics
from mooncake_jax.gateway.stream import Summary, TokenFlow, _Text, run
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
