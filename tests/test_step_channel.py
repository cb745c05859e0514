"""StepChannel (sharding/step_channel.py) over a key-value store with the coordination service's interface: messages
arrive whole and in order, large ones in parts, and the store is emptied once every follower has read them."""

import threading

import numpy as np
import pytest

from mooncake_jax.sharding import step_channel
from mooncake_jax.sharding.step_channel import StepChannel


class Store:
    """The coordination service's key-value calls, in memory (a blocking get waits on a condition)."""

    def __init__(self):
        self.values, self.lock = {}, threading.Condition()

    def key_value_set_bytes(self, key, value, allow_overwrite=False):
        with self.lock:
            assert allow_overwrite or key not in self.values, key
            self.values[key] = bytes(value)
            self.lock.notify_all()

    def blocking_key_value_get_bytes(self, key, timeout_in_ms):
        with self.lock:
            if not self.lock.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise TimeoutError(key)
            return self.values[key]

    def key_value_increment(self, key, increment):
        with self.lock:
            self.values[key] = int(self.values.get(key, 0)) + increment
            return self.values[key]

    def key_value_delete(self, key):
        with self.lock:
            self.values.pop(key, None)


def test_messages_reach_every_follower_in_order_and_leave_the_store(monkeypatch):
    monkeypatch.setattr(step_channel, "PART_BYTES", 1000)  # the big message goes in parts
    store = Store()
    leader = StepChannel(store, 0, 3)
    followers = [StepChannel(store, i, 3) for i in (1, 2)]
    big = np.arange(5000, dtype=np.int32)  # 20 KB: 21 parts
    messages = [("run", [1, 2, 3]), ("write_blocks", (np.array([5, 9]), big)), ("stop", None)]
    got = {1: [], 2: []}

    def follow(channel):
        for _ in messages:
            got[channel.process_index].append(channel.recv())

    threads = [threading.Thread(target=follow, args=(f,)) for f in followers]
    for t in threads:
        t.start()
    for m in messages:
        leader.send(m)
    for t in threads:
        t.join(10)
    for i in (1, 2):
        assert [op for op, _ in got[i]] == ["run", "write_blocks", "stop"]
        assert got[i][0][1] == [1, 2, 3] and np.array_equal(got[i][1][1][1], big)
    assert store.values == {}  # the last reader of each message deleted it (parts and read count)


def test_an_idle_follower_waits_again_and_a_real_error_is_raised(monkeypatch):
    monkeypatch.setattr(step_channel, "WAIT_MS", 50)
    store = Store()
    leader, follower = StepChannel(store, 0, 2), StepChannel(store, 1, 2)
    threading.Timer(0.3, leader.send, args=(("run", 7),)).start()  # six waits run out before it comes
    assert follower.recv() == ("run", 7)

    class Broken(Store):
        def blocking_key_value_get_bytes(self, key, timeout_in_ms):
            raise ConnectionError("coordination service gone")

    with pytest.raises(ConnectionError):
        StepChannel(Broken(), 1, 2).recv()


def test_only_process_0_sends():
    store = Store()
    with pytest.raises(RuntimeError, match="only process 0 sends"):
        StepChannel(store, 1, 2).send(("run", None))
    with pytest.raises(RuntimeError, match="never receives"):
        StepChannel(store, 0, 2).recv()
