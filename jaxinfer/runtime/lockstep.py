"""Lockstep: one engine over several processes on `jax.distributed`, every process in step.

jax's multi-controller SPMD runs a program over a mesh that spans processes only when every
process calls it, in the same order, with the same inputs. One process, the leader (process
0), decides everything: it runs the scheduler, and its executor sends each device call to the
followers before making it (`Leader.send`): the call's name and host inputs, and the device
arrays it reuses by handle (each array an earlier call or put returned gets the next number on
every process, and the leader says when its own copy is gone so that the followers drop
theirs). A follower runs nothing of its own: it calls its executor as it is told
(`Follower.serve`), compiling what the leader compiles, from the same shapes.

The channel is one TCP connection per follower beside jax's collectives, not a collective:
a step's message is a few hundred bytes that would otherwise be one more cross-process
program per step (and per shape), and a socket says at once when its peer is gone (EOF),
which lets a failure be reported instead of hanging in a collective. Messages are pickled;
a follower unpickles only numpy arrays, builtins and the runtime's own input records (no
other callable), from a leader that proved it holds the group's secret (`connect`).

Faults: each side sends a heartbeat every HEARTBEAT seconds (the leader when it has no call to
send) carrying the follower's counters; a peer silent for SILENT seconds, or a closed or
failed connection, is lost. The leader then calls `on_lost(reason)` once (from its monitor
thread: its engine thread may be blocked in a collective with the lost process); a follower
that loses its leader exits the process, since its engine thread may be blocked likewise.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import pickle
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ..errors import JaxinferError

log = logging.getLogger(__name__)

HEARTBEAT = 1.0  # seconds between heartbeats
SILENT = 10.0  # seconds of silence after which a peer counts as lost
CONNECT_TIMEOUT = 300.0  # seconds the leader waits for the followers to connect (they warm up)
# jax's own timeouts, below the loss detection the issue asks for (a dead follower: every
# process out within 60 s) rather than jax's defaults of 100 s and 300 s.
HEARTBEAT_TIMEOUT = 20
SHUTDOWN_TIMEOUT = 30
OPS = ("run", "put", "copy_out", "copy_in")  # the executor's device calls, the follower's menu
_LEN = struct.Struct("!Q")


class ProcessLost(JaxinferError):
    """A process of the group stopped (or failed a call): the group is out of step and ends."""


@dataclass(frozen=True)
class Ref:
    """A device array in a message: its handle (the same on every process)."""

    handle: int


# ---- the wire ---------------------------------------------------------------------------

# What a follower may unpickle: numpy's array and scalar reconstruction, and the records a
# call's inputs are made of (no function, no other class: pickle's classic way to run code).
_ALLOWED = {
    ("numpy", "dtype"), ("numpy", "ndarray"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("jaxinfer.runtime.lockstep", "Ref"),
    ("jaxinfer.runtime.inputs", "Chunk"), ("jaxinfer.runtime.inputs", "DecodeState"),
    ("jaxinfer.model.kvcache", "KVView"), ("jaxinfer.ops.sampling", "SamplingRows"),
    ("builtins", "slice"), ("builtins", "frozenset"), ("builtins", "set"),
}  # fmt: skip


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a lockstep message")
        return super().find_class(module, name)


def send(sock: socket.socket, message) -> int:
    """Send one message; returns its bytes (length prefix included)."""
    data = pickle.dumps(message, protocol=5)
    sock.sendall(_LEN.pack(len(data)) + data)
    return _LEN.size + len(data)


def recv(sock: socket.socket):
    """Receive one message (EOFError when the peer closed the connection)."""
    (n,) = _LEN.unpack(_exactly(sock, _LEN.size))
    return _Unpickler(io.BytesIO(_exactly(sock, n))).load()


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the peer closed the connection")
        got += k
    return bytes(buf)


# ---- handles ------------------------------------------------------------------------------


def _arrays(tree) -> list:
    """The device arrays of a call's outputs, in the order every process numbers them."""
    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


# ---- the leader ---------------------------------------------------------------------------


@dataclass
class _Peer:
    process: int
    sock: socket.socket
    heard: float = field(default_factory=time.monotonic)
    counters: dict = field(default_factory=dict)


class Leader:
    """Process 0's side: sends each device call to every follower before it is made (`send`),
    numbers the arrays the calls return (`track`), and watches the followers."""

    def __init__(self, peers: list[tuple[int, socket.socket]], on_lost=None):
        self.next = 0  # the next handle
        self.peers = [_Peer(p, s) for p, s in peers]
        self.on_lost: Callable[[str], None] | None = on_lost
        self.lost: str | None = None  # why the group ended, once it has
        self.calls = 0  # device calls sent (heartbeats apart)
        self.bytes_sent = 0  # their bytes (to each follower)
        self._handles: dict[int, int] = {}  # id(array) -> handle
        self._freed: list[int] = []  # handles whose array the leader dropped
        self._lock = threading.Lock()  # one sender at a time (engine thread, heartbeats)
        self._sent = time.monotonic()
        self._stop = threading.Event()
        self._listeners = [
            threading.Thread(target=self._listen, args=(peer,), daemon=True,
                             name=f"jaxinfer-lockstep-{peer.process}")
            for peer in self.peers
        ]  # fmt: skip
        for thread in self._listeners:
            thread.start()
        threading.Thread(target=self._beat, daemon=True, name="jaxinfer-lockstep").start()

    def send(self, op: str, *args) -> None:
        """Before the leader's executor makes device call `op(*args)`: every follower gets it.
        Device arrays in `args` must be ones a tracked call returned."""
        if self.lost is not None:
            raise ProcessLost(f"the process group ended: {self.lost}")
        refs = jax.tree.map(self._ref, args)
        with self._lock:
            freed, self._freed = self._freed, []
            self._broadcast((op, refs, freed))

    def track(self, outputs) -> None:
        """Number the device arrays a call (or put) returned, as every follower does."""
        for x in _arrays(outputs):
            handle, self.next = self.next, self.next + 1
            self._handles.setdefault(id(x), handle)
            weakref.finalize(x, self._drop, id(x), handle)

    def engine(self, *args) -> None:
        """Before process 0 makes another engine (bench makes one per layout and slots):
        each follower's `serve` returns `args`, to make the same one and follow it."""
        if self.lost is not None:
            raise ProcessLost(f"the process group ended: {self.lost}")
        with self._lock:
            self._broadcast(("engine", args, []))

    def counters(self) -> list[dict]:
        """Each follower's last reported counters, in process order."""
        return [dict(p.counters, process=p.process) for p in self.peers]

    def close(self) -> None:
        """Stop the followers: each leaves jax.distributed and exits (`leave`)."""
        self._stop.set()
        with self._lock:
            if self.lost is None:
                with contextlib.suppress(ProcessLost):
                    self._broadcast(("stop", (), []))

    def _gone(self, timeout: float) -> None:
        """Wait (at most `timeout` seconds) until every follower closed its connection."""
        deadline = time.monotonic() + timeout
        for thread in self._listeners:
            thread.join(max(deadline - time.monotonic(), 0))
        for peer in self.peers:
            with _quiet():
                peer.sock.close()

    def _ref(self, x):
        if isinstance(x, jax.Array):
            if id(x) not in self._handles:
                raise JaxinferError("a device array the followers do not hold went to a call")
            return Ref(self._handles[id(x)])
        return x

    def _drop(self, key: int, handle: int) -> None:
        if self._handles.get(key) == handle:
            del self._handles[key]
        self._freed.append(handle)  # (list.append is atomic: any thread may drop an array)

    def _broadcast(self, message) -> None:
        data = pickle.dumps(message, protocol=5)
        frame = _LEN.pack(len(data)) + data
        for peer in self.peers:
            try:
                peer.sock.sendall(frame)
            except OSError as e:
                self._lose(f"process {peer.process} is gone ({e.strerror or e})")
                raise ProcessLost(f"the process group ended: {self.lost}") from None
        if message[0] in OPS:
            self.calls += 1
            self.bytes_sent += len(frame)
        self._sent = time.monotonic()

    def _listen(self, peer: _Peer) -> None:
        """A follower's heartbeats (its counters) until it goes."""
        try:
            while not self._stop.is_set():
                kind, counters = recv(peer.sock)
                if kind == "failed":
                    raise ProcessLost(f"a call failed there: {counters}")
                peer.heard, peer.counters = time.monotonic(), counters
        except (OSError, EOFError, pickle.UnpicklingError, ProcessLost) as e:
            if not self._stop.is_set():
                self._lose(f"process {peer.process} is gone ({e})")
        # (after close(): the follower left jax.distributed and exited; `leave` waits here)

    def _beat(self) -> None:
        """Heartbeats when no call went out lately, and the followers' silence checked."""
        while not self._stop.wait(HEARTBEAT / 2):
            now = time.monotonic()
            for peer in self.peers:
                if now - peer.heard > SILENT:
                    self._lose(f"process {peer.process} did not answer for {SILENT:.0f} s")
            if self.lost is None and now - self._sent >= HEARTBEAT and self._lock.acquire(False):
                try:
                    self._broadcast(("beat", (), []))
                except ProcessLost:
                    pass  # (lost: said by _lose)
                finally:
                    self._lock.release()

    def _lose(self, reason: str) -> None:
        if self.lost is not None:
            return
        self.lost = reason
        log.error("lockstep: %s; the process group ends", reason)
        if self.on_lost is not None:
            self.on_lost(reason)


# ---- a follower ---------------------------------------------------------------------------


class Follower:
    """A follower's side: runs the leader's device calls on `executor` (Engine.follow sets
    it) in order (`serve`); its heartbeats carry `counters()`."""

    def __init__(self, sock: socket.socket, counters: Callable[[], dict] = dict):
        self.next = 0  # the next handle
        self.sock, self.counters = sock, counters
        self.executor: Any = None
        self._inbox: list = []  # messages the reader thread received, in order
        self._ready = threading.Condition()
        self._reading = False
        self.arrays: dict[int, object] = {}  # handle -> this process's device array
        self.calls = 0
        self._send = threading.Lock()

    def serve(self):
        """Run the leader's calls until it says stop (returns None) or moves to another engine
        (returns the arguments it gave: a command that makes several engines, e.g. bench,
        makes the same one and follows again); exits the process if the leader is lost (this
        thread may be blocked in a collective the leader will never join)."""
        if not self._reading:
            self._reading = True
            threading.Thread(target=self._read, daemon=True,
                             name="jaxinfer-lockstep-read").start()  # fmt: skip
            threading.Thread(target=self._beat, daemon=True, name="jaxinfer-lockstep").start()
        while True:
            with self._ready:
                self._ready.wait_for(lambda: self._inbox)
                op, args, freed = self._inbox.pop(0)
            for handle in freed:
                self.arrays.pop(handle, None)
            if op == "stop":
                return None
            if op == "engine":
                return args
            try:
                self.apply(op, args)
            except Exception as e:  # the group is out of step: say so, and end
                log.exception("lockstep: call %s failed", op)
                with _quiet(), self._send:
                    send(self.sock, ("failed", f"{op}: {e}"))
                _exit(f"call {op} failed")

    def apply(self, op: str, args) -> None:
        if op not in OPS:
            raise JaxinferError(f"unknown lockstep call {op!r}")
        args = jax.tree.map(lambda x: self.arrays[x.handle] if isinstance(x, Ref) else x, args)
        outputs = getattr(self.executor, op)(*args)
        if op in ("run", "put"):
            for x in _arrays(outputs):
                self.arrays[self.next] = x
                self.next += 1
        self.calls += 1

    def _read(self) -> None:
        self.sock.settimeout(SILENT)
        try:
            while True:
                message = recv(self.sock)
                if message[0] == "beat":
                    continue
                with self._ready:
                    self._inbox.append(message)
                    self._ready.notify()
                if message[0] == "stop":
                    return
        except (OSError, EOFError, pickle.UnpicklingError) as e:
            _exit(f"the leader is gone ({e or 'silent'})")

    def _beat(self) -> None:
        while True:
            try:
                with self._send:
                    send(self.sock, ("beat", self.counters()))
            except OSError:
                return  # the reader sees the connection end
            time.sleep(HEARTBEAT)


def leave(member: Leader | Follower) -> None:
    """Leave `jax.distributed` once the leader has stopped the group (Leader.close). jax's
    shutdown is a barrier of every process, after which process 0 also stops the coordination
    service: were it to stop while a follower still disconnects, that follower's jax would
    abort it. So the leader keeps the service up until every follower has exited."""
    from jax._src import distributed

    if isinstance(member, Follower):
        jax.distributed.shutdown()
        with _quiet():
            member.sock.close()
        return
    state = distributed.global_state
    service, state.service = state.service, None
    jax.distributed.shutdown()  # the barrier, then this process's client
    member._gone(SHUTDOWN_TIMEOUT)
    if service is not None:
        service.shutdown()


def _exit(reason: str) -> None:
    log.error("lockstep: %s; this process exits", reason)
    logging.shutdown()
    os._exit(3)


class _quiet:
    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return exc[0] is not None and issubclass(exc[0], OSError)


# ---- the group ------------------------------------------------------------------------------


def initialize(coordinator: str | None, processes: int | None, process_id: int | None) -> bool:
    """Join `jax.distributed` when asked: by the three values, by JAX_COORDINATOR_ADDRESS, or by
    a cluster jax detects (SLURM, a TPU slice...); True when this process is in a group of
    several. jax's heartbeat and shutdown timeouts are set below the group's loss detection."""
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    given = (coordinator, processes, process_id)
    if any(v is not None for v in given) and not all(v is not None for v in given):
        if not _cluster():  # (a cluster tells jax the other two)
            raise JaxinferError(
                "--coordinator (or JAX_COORDINATOR_ADDRESS), --num-processes and --process-id "
                "go together; pass all three (or none, for one process)"
            )
    if processes is not None and not 0 <= process_id < processes:  # type: ignore[operator]
        raise JaxinferError(f"--process-id {process_id} is not in [0, {processes})")
    if coordinator is None and not _cluster():
        return False
    jax.distributed.initialize(
        coordinator, num_processes=processes, process_id=process_id,
        heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT, shutdown_timeout_seconds=SHUTDOWN_TIMEOUT,
    )  # fmt: skip
    return jax.process_count() > 1


def _cluster() -> bool:
    """Whether jax would find a job of several processes by itself: a SLURM or Open MPI job,
    or a Cloud TPU slice of several hosts (jax's opt-in methods, and Kubernetes, where every
    pod would look like a cluster, are left to the explicit ways)."""
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # another jax's internals: only the explicit ways count
        return False
    for env in ClusterEnv._cluster_types:
        if env.opt_in_only_method or env.__name__ == "K8sCluster":
            continue
        try:
            if env.is_env_present() and env.get_process_count() > 1:
                return True
        except Exception:  # a half-present environment: not a cluster to join
            continue
    return False


def connect(
    identity: str, counters: Callable[[], dict] = dict, timeout: float = CONNECT_TIMEOUT
) -> Leader | Follower:
    """Open the group's channel, on every process of a `jax.distributed` group at once (after
    the engine warmed up): the leader gets a Leader (for Engine.lead), a follower a Follower
    (for Engine.follow; its heartbeats carry `counters()`). `identity` names what each process
    built (the model, its options and shapes): a follower whose identity is not the leader's
    would compile other programs and hang the group, so the leader refuses to start.
    The leader listens on a free port of the coordinator's host (the one address every process
    can reach); the port and a fresh secret reach the followers by one jax broadcast, and a
    follower is accepted only with the secret, so no one else reads the calls (they hold the
    users' prompts)."""
    from jax.experimental import multihost_utils

    leader = jax.process_index() == 0
    listener = None
    word = np.zeros(5, np.uint32)  # port, then 128 bits of secret
    if leader:
        listener = socket.create_server((_coordinator_host(), 0))
        word[0] = listener.getsockname()[1]
        word[1:] = np.frombuffer(secrets.token_bytes(16), np.uint32)
    word = np.asarray(multihost_utils.broadcast_one_to_all(word))
    port, secret = int(word[0]), word[1:].tobytes()
    if listener is None:
        sock = socket.create_connection((_coordinator_host(), port), timeout=timeout)
        sock.settimeout(None)
        sock.sendall(secret + struct.pack("!I", jax.process_index()) + _digest(identity))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Follower(sock, counters)
    peers: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout
    with listener:
        while len(peers) < jax.process_count() - 1:
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                raise JaxinferError(
                    f"{jax.process_count() - 1 - len(peers)} process(es) did not join in "
                    f"{timeout:.0f} s"
                ) from None
            sock.settimeout(10.0)
            try:
                hello = _exactly(sock, len(secret) + 4 + 32)
            except (OSError, EOFError):
                sock.close()
                continue
            if not secrets.compare_digest(hello[: len(secret)], secret):
                sock.close()  # not one of ours
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            (process,) = struct.unpack("!I", hello[len(secret) : len(secret) + 4])
            peers[process] = sock
            if hello[len(secret) + 4 :] != _digest(identity):
                for other in peers.values():
                    other.close()
                raise JaxinferError(
                    f"process {process} loaded another model, or with other options, than "
                    "process 0; start every process with the same model and flags"
                )
    return Leader(sorted(peers.items()))


def _digest(identity: str) -> bytes:
    return hashlib.sha256(identity.encode()).digest()


def _coordinator_host() -> str:
    from jax._src import distributed

    address = distributed.global_state.coordinator_address or ""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host or "127.0.0.1"
