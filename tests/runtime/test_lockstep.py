"""The lockstep channel in one process, over a socket pair (the two-process server is
tests/serve/test_group_server.py): a follower runs the leader's calls in order with its own
arrays in place of the handles, drops the arrays the leader dropped, unpickles nothing but
data, and a follower that goes is reported to the leader at once."""

import io
import os
import pickle
import socket
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.runtime import lockstep
from jaxinfer.runtime.inputs import Chunk


class Device:
    """An executor's device calls: each returns device arrays made from its inputs, and
    records what it got."""

    def __init__(self):
        self.calls = []

    def put(self, tree):
        self.calls.append(("put", tree))
        return jnp.asarray(tree) * 1

    def run(self, name, *inputs):
        self.calls.append(("run", name, inputs))
        x = inputs[0]
        return jnp.asarray(x) + 1, jnp.asarray(x) * 2


def _pair():
    a, b = socket.socketpair()
    lost = []
    leader = lockstep.Leader([(1, a)], on_lost=lost.append)
    follower = lockstep.Follower(b)
    follower.executor = Device()
    return leader, follower, lost


def test_a_follower_runs_the_calls_with_its_own_arrays():
    leader, follower, lost = _pair()
    mine = Device()  # the leader's executor does the same, and numbers what it gets
    placed = mine.put(np.arange(3, dtype=np.int32))
    leader.send("put", np.arange(3, dtype=np.int32))
    leader.track(placed)
    chunk = Chunk(np.ones((1, 2), np.int32), None)  # type: ignore[arg-type]
    leader.send("run", "decode", placed, chunk)
    out = mine.run("decode", placed, chunk)
    leader.track(out)
    mine.calls.clear()
    del placed, out  # the leader's copies go: the followers drop theirs with the next call
    leader.send("run", "decode", np.int32(7))
    leader.close()
    assert follower.serve() is None  # returns at "stop"
    kinds = [c[0] for c in follower.executor.calls]
    assert kinds == ["put", "run", "run"]
    _, name, inputs = follower.executor.calls[1]
    assert name == "decode"
    np.testing.assert_array_equal(np.asarray(inputs[0]), [0, 1, 2])  # its own put's array
    assert isinstance(inputs[1], Chunk) and inputs[1].tokens.shape == (1, 2)
    assert set(follower.arrays) == {3, 4}  # handles 0-2 dropped; the last call's outputs kept
    assert not lost


def test_an_array_the_followers_do_not_hold_is_refused():
    leader, follower, _ = _pair()
    with pytest.raises(lockstep.JaxinferError, match="do not hold"):
        leader.send("run", "decode", jnp.ones(2))
    leader.close()
    assert follower.serve() is None and not follower.executor.calls  # nothing went out


class _Shell:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_a_message_that_would_run_code_is_refused():
    data = pickle.dumps(("run", (_Shell(),), []), protocol=5)
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        lockstep._Unpickler(io.BytesIO(data)).load()
    a, b = socket.socketpair()
    a.sendall(lockstep._LEN.pack(len(data)) + data)
    with pytest.raises(pickle.UnpicklingError):
        lockstep.recv(b)


def test_a_follower_that_goes_is_lost_at_once():
    leader, follower, lost = _pair()
    seen = threading.Event()
    leader.on_lost = lambda reason: (lost.append(reason), seen.set())
    follower.sock.close()
    assert seen.wait(5)
    assert "process 1 is gone" in lost[0]
    with pytest.raises(lockstep.ProcessLost, match="process group ended"):
        leader.send("run", "decode", np.int32(1))


def test_a_silent_follower_is_lost(monkeypatch):
    monkeypatch.setattr(lockstep, "SILENT", 1.0)
    leader, follower, lost = _pair()  # the follower never serves: no heartbeat comes
    t0 = time.monotonic()
    while not lost and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert lost and "did not answer" in lost[0]
    follower.sock.close()
