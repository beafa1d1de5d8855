"""ExecutableStore: compiled programs saved to disk, so that a later process calls them without
tracing, lowering or compiling (`jax.experimental.serialize_executable`).

jax's persistent compilation cache is keyed by the lowered module, so a hit there still traces
and lowers every program. The store is keyed by what the program is called on instead: the
compile cache's key (program, static config, mesh, every argument leaf's shape, dtype and
sharding) and the environment it was compiled in (`fingerprint()`: jaxinfer's own sources, jax
and jaxlib, the backend and its devices, the host CPU's flags, XLA_FLAGS, the CPU kernel
variant). Any difference is a miss; a miss compiles and saves.

Loading is unpickling, which can run code: only files this process could have written are
read. The directory is the user's own, mode 0700, each file 0600 and owned by the user; a file
that is not, or that is truncated, corrupt or from another format, is passed over (a debug
line) and the program compiles. Writes go to a temporary file renamed into place, so two
processes sharing the store never read half a file. The store holds at most `capacity` bytes;
past that the least recently used files go.

File layout: MAGIC, then the key text, the serialized executable and the pickled argument and
output trees (each behind its 8-byte length), then the SHA-256 of all that.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import stat
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import jax

log = logging.getLogger("jaxinfer.store")

MAGIC = b"jaxinfer-executable 1\n"
SUFFIX = ".jxe"
SUBFOLDER = "executables"  # of the compile cache dir
DEFAULT_CAPACITY = 2 << 30  # bytes


@dataclass(frozen=True)
class Usage:
    files: int
    bytes: int


class ExecutableStore:
    def __init__(self, directory: str | Path, capacity: int = DEFAULT_CAPACITY, fingerprint=""):
        """The store in `directory` (created 0700 on the first save), at most `capacity`
        bytes; `fingerprint` (see fingerprint()) begins every key."""
        self.directory = Path(directory).expanduser()
        self.capacity = capacity
        self.fingerprint = fingerprint
        self.loaded = 0  # executables this process loaded from here
        self.saved = 0
        self._pending: dict[str, concurrent.futures.Future] = {}  # file name -> _read()
        self._manifest: Path | None = None  # prefetch()'s session file
        self._listed: list = []  # [file name, device ids] in it
        self._lock = threading.Lock()

    @staticmethod
    def inside(cache_dir: str | Path, capacity: int = DEFAULT_CAPACITY, fingerprint=""):
        """The store of a compile cache dir: its `executables` folder."""
        return ExecutableStore(Path(cache_dir).expanduser() / SUBFOLDER, capacity, fingerprint)

    # ---- the directory ------------------------------------------------------------------

    def _usable(self, create: bool) -> bool:
        """Whether the directory is this user's own and private (created 0700 if asked)."""
        if create:
            try:
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as e:
                log.debug("executable store %s not created: %s", self.directory, e.strerror)
                return False
        why = _not_private(self.directory, stat.S_ISDIR)
        if why:
            log.debug("executable store %s ignored: %s", self.directory, why)
        return why is None

    def usage(self) -> Usage:
        files = list(self._files())
        return Usage(len(files), sum(s.st_size for _, s in files))

    def clear(self) -> int:
        """Delete every stored executable (and the sessions' manifests); returns how many."""
        n = 0
        for path, _ in self._files():
            try:
                path.unlink()
                n += 1
            except OSError:
                pass
        if self._usable(create=False):
            for path in self.directory.glob("*.json"):
                path.unlink(missing_ok=True)
        return n

    def _files(self):
        if not self._usable(create=False):
            return
        for path in self.directory.glob("*" + SUFFIX):
            try:
                yield path, path.lstat()
            except OSError:
                continue

    # ---- one executable -----------------------------------------------------------------

    def path(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest()[:40] + SUFFIX)

    def load(self, key: str, devices):
        """The executable (a jax `Compiled`) stored under `key`, to run on `devices` (in the
        order it was compiled for), or None."""
        path = self.path(key)
        ids = [d.id for d in devices]
        early = self._pending.pop(path.name, None)  # read ahead by prefetch()
        got = early.result() if early is not None else None
        if got is None or got[2] != ids:
            got = self._read(path, devices)
        if got is None or got[0] != key:
            return None
        self.loaded += 1
        try:
            os.utime(path)  # least recently used goes first
        except OSError:
            pass
        self._remember(path.name, ids)
        return got[1]

    def _read(self, path: Path, devices) -> tuple[str, object, list[int]] | None:
        """(key, executable, device ids) of one file, if it is the user's own and whole."""
        if not path.exists() or not self._usable(create=False):
            return None
        why = _not_private(path, stat.S_ISREG)
        if why:
            log.debug("executable %s ignored: %s", path.name, why)
            return None
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            with os.fdopen(fd, "rb") as f:
                key, payload, in_tree, out_tree = _unpack(f.read())
            compiled = _deserialize(payload, in_tree, out_tree, devices)
        except Exception as e:  # a bad file is a miss: the program compiles and overwrites it
            log.debug("executable %s not loaded: %s", path.name, str(e).splitlines()[0][:200])
            return None
        return key, compiled, [d.id for d in devices]

    # ---- reading ahead ------------------------------------------------------------------

    def prefetch(self, session: str) -> None:
        """Start reading, on a background thread, the executables that the last engine of
        `session` (a digest of the model and options) loaded or compiled, so that they load
        while the weights are placed. What it reads is used only by a load() of the same key
        on the same devices; the rest is dropped."""
        self._manifest = self.directory / f"{session}.json"
        try:
            if _not_private(self._manifest, stat.S_ISREG) is None:
                listed = json.loads(self._manifest.read_text())
                self._listed = [[name, list(ids)] for name, ids in listed]
        except (OSError, ValueError, TypeError) as e:
            log.debug("executable store manifest %s ignored: %s", self._manifest.name, e)
        by_id = {d.id: d for d in jax.devices()}
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-store")
        for name, ids in self._listed:
            if all(i in by_id for i in ids) and name.endswith(SUFFIX) and "/" not in name:
                devices = [by_id[i] for i in ids]
                self._pending[name] = pool.submit(self._read, self.directory / name, devices)
        pool.shutdown(wait=False)

    def _remember(self, name: str, ids: list[int]) -> None:
        """Add an executable to the session's manifest (what prefetch() reads next time)."""
        with self._lock:  # warmup's threads
            if self._manifest is None or [name, ids] in self._listed or len(self._listed) >= 64:
                return
            self._listed.append([name, ids])
            try:
                _write(self.directory, self._manifest, json.dumps(self._listed).encode())
            except OSError as e:
                log.debug("executable store manifest not written: %s", e.strerror)

    def save(self, key: str, compiled, devices) -> bool:
        """Store `compiled` (which runs on `devices`) under `key`; False when it cannot be
        (never raises)."""
        from jax.experimental import serialize_executable

        if not self._usable(create=True):
            return False
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            data = _pack(key, payload, pickle.dumps((in_tree, out_tree)))
            _write(self.directory, self.path(key), data)
        except Exception as e:  # e.g. a program with closed-over constants, a full disk
            log.debug("executable not stored: %s", str(e).splitlines()[0][:200])
            return False
        self.saved += 1
        self._trim()
        self._remember(self.path(key).name, [d.id for d in devices])
        return True

    def _trim(self) -> None:
        """Drop the least recently used files until the store fits its capacity."""
        files = sorted(self._files(), key=lambda f: f[1].st_mtime)
        total = sum(s.st_size for _, s in files)
        for path, s in files:
            if total <= self.capacity:
                break
            path.unlink(missing_ok=True)
            total -= s.st_size


def _write(directory: Path, path: Path, data: bytes) -> None:
    """Write a file atomically (a temporary file renamed into place), 0600."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:  # mkstemp makes it 0600
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _not_private(path: Path, kind) -> str | None:
    """Why `path` is not this user's own private file or directory (None: it is)."""
    try:
        s = path.lstat()
    except OSError as e:
        return e.strerror
    if not kind(s.st_mode):
        return "not a regular file or directory (a link?)"
    if s.st_uid != os.geteuid():
        return f"owned by uid {s.st_uid}, not {os.geteuid()}"
    if s.st_mode & 0o077:
        return f"mode {stat.S_IMODE(s.st_mode):04o}, readable or writable by others"
    return None


def _pack(key: str, *parts: bytes) -> bytes:
    body = MAGIC + b"".join(struct.pack("<Q", len(p)) + p for p in (key.encode(), *parts))
    return body + hashlib.sha256(body).digest()


def _unpack(data: bytes) -> tuple:
    """(key, payload, in_tree, out_tree) of a stored file."""
    body, digest = data[:-32], data[-32:]
    if not body.startswith(MAGIC):
        raise ValueError("not a jaxinfer executable of this format")
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch (truncated or corrupt)")
    parts, at = [], len(MAGIC)
    while at < len(body):
        (n,) = struct.unpack_from("<Q", body, at)
        parts.append(body[at + 8 : at + 8 + n])
        at += 8 + n
    if len(parts) != 3:
        raise ValueError("not a jaxinfer executable of this format")
    in_tree, out_tree = pickle.loads(parts[2])
    return parts[0].decode(), parts[1], in_tree, out_tree


def _deserialize(payload: bytes, in_tree, out_tree, devices):
    from jax.experimental import serialize_executable

    backend = devices[0].client
    return serialize_executable.deserialize_and_load(
        payload, in_tree, out_tree, backend, execution_devices=devices
    )


@functools.cache
def _sources_digest() -> str:
    """SHA-256 of jaxinfer's own sources (Python and kernels): a program from other code is
    another program."""
    root = Path(__file__).parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".cc", ".h", ".toml") and "__pycache__" not in path.parts:
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def fingerprint(kernel_variant: str | None, cpu_flags) -> str:
    """What besides the program's own key decides its executable: the code, jax, the devices
    and the host (XLA:CPU compiles for the host's instruction set)."""
    import jaxlib

    backend = jax.devices()[0].client
    devices = jax.devices()
    env = {k: os.environ.get(k, "") for k in ("XLA_FLAGS", "JAXINFER_CPU_KERNELS",
                                              "JAXINFER_KERNELS", "LIBTPU_INIT_ARGS")}  # fmt: skip
    return "\n".join(
        [
            f"jaxinfer sources {_sources_digest()}",
            f"jax {jax.__version__} jaxlib {jaxlib.__version__}",
            f"backend {backend.platform} {backend.platform_version}",
            f"devices {len(devices)} x {devices[0].device_kind}; process "
            f"{jax.process_index()} of {jax.process_count()}",
            f"host {platform.machine()} cpu flags {' '.join(sorted(cpu_flags))}",
            f"kernels {kernel_variant}",
            *(f"env {k}={v}" for k, v in env.items()),
        ]
    )
