"""Continuous batching over an Engine: sequences join and leave between decode steps.

Each ``step()`` first admits waiting sequences (FIFO, while the batch has room and the cache can take them) and
prefills them, then runs one decode step for every running sequence, then retires the finished ones and frees their
pages. A sequence that can never fit is rejected when it is submitted, never half-way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .engine import Engine
from .kv_cache import OutOfPages
from .sequence import SamplingParams, Sequence

TokenCallback = Callable[[Sequence, int], None]


class ContinuousBatcher:
    def __init__(self, engine: Engine, on_token: TokenCallback | None = None):
        self.engine = engine
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.on_token = on_token

    def submit(self, prompt, params: SamplingParams | None = None) -> Sequence:
        seq = self.engine.new_sequence(prompt, params)
        self.waiting.append(seq)
        return seq

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def _emit(self, seq: Sequence) -> None:
        if self.on_token is not None:
            self.on_token(seq, seq.output[-1])

    def _retire(self) -> list[Sequence]:
        done = [s for s in self.running if s.finished]
        for seq in done:
            self.engine.release(seq)
        self.running = [s for s in self.running if not s.finished]
        return done

    def step(self) -> list[Sequence]:
        """Admit, prefill, decode once; returns the sequences that finished in this step."""
        while self.waiting and len(self.running) < self.engine.max_batch:
            seq = self.waiting[0]
            try:
                self.engine.admit(seq)
            except OutOfPages:
                if not self.running:
                    raise  # nothing will ever free pages: a bug, not a wait
                break
            self.waiting.popleft()
            self.engine.prefill(seq)
            self._emit(seq)
            self.running.append(seq)
        finished = self._retire()
        if self.running:
            self.engine.decode(self.running)
            for seq in self.running:
                self._emit(seq)
        return finished + self._retire()

    def run(self) -> None:
        while not self.idle:
            self.step()
