"""ExecutableStore: compiled programs saved to disk, so that a later process calls them without
tracing, lowering or compiling (`jax.experimental.serialize_executable`).

jax's persistent compilation cache is keyed by the lowered module, so a hit there still traces
and lowers every program. The store is keyed by what the program is called on instead: the
compile cache's key (program, static config, mesh, every argument leaf's shape, dtype and
sharding, the jax options that change the program) and the environment it was compiled in
(`fingerprint()`: jaxinfer's own sources, jax and jaxlib, the backend and its devices, the host
CPU's flags, XLA_FLAGS, the CPU kernel variant, those jax options). Any difference is a miss; a
miss compiles and saves.

Loading is unpickling, which can run code: only files this user wrote are read, and checked on
the descriptor that reads them, not by a path that could change in between. The folder is
opened without following a link and must be the user's own, mode 0700, in a parent folder that
no one else can rename it out of (the user's or root's, writable by others only if sticky, as
/tmp); each file is opened in that folder without following a link and must be a regular file,
the user's own, 0600. The stored key is compared before anything is unpickled. A file that
fails, or is truncated, corrupt or from another format, is passed over (a debug line) and the
program compiles. Writes go to a temporary file renamed into place, so two processes sharing
the store never read half a file. The processes of one engine on `jax.distributed` may share
a folder: each saves and loads its own executables (its part of a mesh over all processes'
devices), kept apart by the fingerprint's `process i of n`, and they share its capacity; one
that misses compiles while the others load (compiling takes no collective). The store holds
at most `capacity` bytes, temporary files included; past that the least recently used
executables go, and temporary files an interrupted write left (older than STALE seconds) go
at every save and clear.

File layout: MAGIC, then the key text, the serialized executable and the pickled argument and
output trees (each behind its 8-byte length), then the SHA-256 of all that.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import platform
import secrets
import stat
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jax

log = logging.getLogger("jaxinfer.store")

MAGIC = b"jaxinfer-executable 1\n"
SUFFIX = ".jxe"
TEMPORARY = ".tmp-"  # prefix of a file being written
STALE = 600  # seconds: a temporary file older than this is an interrupted write's
SUBFOLDER = "executables"  # of the compile cache dir
DEFAULT_CAPACITY = 2 << 30  # bytes

# jax options that change the program jax emits or how XLA compiles it; a name the installed
# jax lacks is left out
JAX_OPTIONS = (
    "jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
    "jax_threefry_partitionable", "jax_threefry_gpu_kernel_lowering", "jax_random_seed_offset",
    "jax_high_dynamic_range_gumbel", "jax_use_shardy_partitioner",
    "jax_remove_size_one_mesh_axis_from_type", "jax_ragged_dot_use_ragged_dot_instruction",
    "jax_ragged_dot_use_gpu_pallas_triton_lowering", "jax_pallas_use_mosaic_gpu",
    "jax_mosaic_allow_hlo", "jax_optimization_level", "jax_exec_time_optimization_effort",
    "jax_memory_fitting_effort", "jax_memory_fitting_level", "jax_compiler_enable_remat_pass",
    "jax_disable_most_optimizations", "jax_enable_pgle", "jax_xla_profile_version",
)  # fmt: skip

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)  # a link: ELOOP
_FOLDER = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: a FIFO does not block the open; it is refused on the descriptor (not a file)
_FILE = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | _NOFOLLOW


@dataclass(frozen=True)
class Usage:
    files: int  # executables
    bytes: int  # of those and of the temporary files
    temporary: int = 0  # files being written, or left by an interrupted write


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
        self._manifest: str | None = None  # prefetch()'s session file
        self._listed: list = []  # [file name, device ids] in it
        self._lock = threading.Lock()

    @staticmethod
    def inside(cache_dir: str | Path, capacity: int = DEFAULT_CAPACITY, fingerprint=""):
        """The store of a compile cache dir: its `executables` folder."""
        return ExecutableStore(Path(cache_dir).expanduser() / SUBFOLDER, capacity, fingerprint)

    # ---- the directory ------------------------------------------------------------------

    @contextlib.contextmanager
    def _folder(self, create: bool = False):
        """The store folder's descriptor (see open_folder), or None where it is not safe or
        not there (created 0700 if asked)."""
        fd = None
        try:
            if create:  # a compile cache dir made here is private too (open_folder's parent)
                self.directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                self.directory.mkdir(mode=0o700, exist_ok=True)
            fd = open_folder(self.directory)
        except FileNotFoundError:
            pass  # nothing stored yet
        except OSError as e:
            log.debug("executable store %s ignored: %s", self.directory, e)
        try:
            yield fd
        finally:
            if fd is not None:
                os.close(fd)

    def usage(self) -> Usage:
        with self._folder() as d:
            files = _listing(d) if d is not None else []
        executables = sum(name.endswith(SUFFIX) for name, _ in files)
        return Usage(executables, sum(s.st_size for _, s in files), len(files) - executables)

    def clear(self) -> int:
        """Delete every stored executable, the sessions' manifests and the temporary files of
        interrupted writes; returns how many executables."""
        n = 0
        with self._folder() as d:
            for name, s in _listing(d, manifests=True) if d is not None else []:
                if name.startswith(TEMPORARY) and not _stale(s):
                    continue  # another process is writing it
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=d)
                    n += name.endswith(SUFFIX)
        return n

    # ---- one executable -----------------------------------------------------------------

    def path(self, key: str) -> Path:
        return self.directory / (hashlib.sha256(key.encode()).hexdigest()[:40] + SUFFIX)

    def load(self, key: str, devices):
        """The executable (a jax `Compiled`) stored under `key`, to run on `devices` (in the
        order it was compiled for), or None."""
        name = self.path(key).name
        ids = [d.id for d in devices]
        early = self._pending.pop(name, None)  # read ahead by prefetch()
        got = early.result() if early is not None else None
        if got is None or got[0] != key or got[2] != ids:
            got = self._read(name, devices, key)
        if got is None:
            return None
        self.loaded += 1
        self._remember(name, ids)
        return got[1]

    def _read(self, name: str, devices, key: str | None) -> tuple[str, object, list[int]] | None:
        """(key, executable, device ids) of the file `name` if it is the user's own, whole and
        holds `key` (None: the key its name stands for, in this store's environment); nothing
        is unpickled before that is known."""
        with self._folder() as d:
            if d is None:
                return None
            try:
                stored, payload, trees = _unpack(_read_private(d, name))
                if not (stored == key if key is not None else self._ours(name, stored)):
                    raise ValueError("it holds another key")
                in_tree, out_tree = pickle.loads(trees)
                compiled = _deserialize(payload, in_tree, out_tree, devices)
            except FileNotFoundError:
                return None
            except Exception as e:  # a bad file is a miss: the program compiles, overwrites it
                log.debug("executable %s not loaded: %s", name, str(e).splitlines()[0][:200])
                return None
            with contextlib.suppress(OSError):  # the least recently used go first
                os.utime(name, dir_fd=d, follow_symlinks=False)
        return stored, compiled, [device.id for device in devices]

    def _ours(self, name: str, key: str) -> bool:
        """Whether `key` is the one the file `name` is stored under, in this environment."""
        return self.path(key).name == name and key.startswith(self.fingerprint + "\n")

    # ---- reading ahead ------------------------------------------------------------------

    def prefetch(self, session: str) -> None:
        """Start reading, on a background thread, the executables that the last engine of
        `session` (a digest of the model and options) loaded or compiled, so that they load
        while the weights are placed. What it reads is used only by a load() of the same key
        on the same devices; the rest is dropped."""
        self._manifest = f"{session}.json"
        with self._folder() as d:
            try:
                if d is not None:
                    listed = json.loads(_read_private(d, self._manifest))
                    self._listed = [[name, list(ids)] for name, ids in listed]
            except (OSError, ValueError, TypeError) as e:
                log.debug("executable store manifest %s ignored: %s", self._manifest, e)
        by_id = {d.id: d for d in jax.devices()}
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-store")
        for name, ids in self._listed:
            if all(i in by_id for i in ids) and name.endswith(SUFFIX) and "/" not in name:
                devices = [by_id[i] for i in ids]
                self._pending[name] = pool.submit(self._read, name, devices, None)
        pool.shutdown(wait=False)

    def _remember(self, name: str, ids: list[int]) -> None:
        """Add an executable to the session's manifest (what prefetch() reads next time)."""
        with self._lock:  # warmup's threads
            if self._manifest is None or [name, ids] in self._listed or len(self._listed) >= 64:
                return
            self._listed.append([name, ids])
            with self._folder() as d:
                try:
                    if d is not None:
                        _write(d, self._manifest, json.dumps(self._listed).encode())
                except OSError as e:
                    log.debug("executable store manifest not written: %s", e.strerror)

    def save(self, key: str, compiled, devices) -> bool:
        """Store `compiled` (which runs on `devices`) under `key`; False when it cannot be
        (never raises)."""
        from jax.experimental import serialize_executable

        name = self.path(key).name
        with self._folder(create=True) as d:
            if d is None:
                return False
            try:
                payload, in_tree, out_tree = serialize_executable.serialize(compiled)
                _write(d, name, _pack(key, payload, pickle.dumps((in_tree, out_tree))))
            except Exception as e:  # e.g. a program with closed-over constants, a full disk
                log.debug("executable not stored: %s", str(e).splitlines()[0][:200])
                return False
            self.saved += 1
            self._trim(d)
        self._remember(name, [device.id for device in devices])
        return True

    def _trim(self, d: int) -> None:
        """Drop stale temporary files, and the least recently used executables until the
        store (temporary files included) fits its capacity."""
        files = sorted(_listing(d), key=lambda f: f[1].st_mtime)
        total = sum(s.st_size for _, s in files)
        for name, s in files:
            temporary = name.startswith(TEMPORARY)
            if (temporary and _stale(s)) or (not temporary and total > self.capacity):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=d)
                    total -= s.st_size


def open_folder(path: Path) -> int:
    """A descriptor of the folder `path`, if only this user can change what it holds: opened
    without following a link, the user's own, mode 0700 or less, in a parent folder that is
    the user's or root's and writable by others only if sticky (else OSError, saying why)."""
    path = Path(os.path.abspath(path))
    parent = os.open(path.parent, _FOLDER)
    try:
        s = os.fstat(parent)
        if s.st_uid not in (0, os.geteuid()):
            raise PermissionError(f"its parent folder is owned by uid {s.st_uid}")
        if s.st_mode & 0o022 and not s.st_mode & stat.S_ISVTX:
            mode = stat.S_IMODE(s.st_mode)
            raise PermissionError(f"its parent folder (mode {mode:04o}) is writable by others")
        fd = os.open(path.name, _FOLDER | _NOFOLLOW, dir_fd=parent)
    finally:
        os.close(parent)
    try:
        _check(os.fstat(fd), stat.S_ISDIR)
    except OSError:
        os.close(fd)
        raise
    return fd


def make_private(path: Path) -> None:
    """Take group and other bits off a folder of this user's own (an older jaxinfer's cache
    folder, made with the umask's mode); anything else is left as it is."""
    try:
        fd = os.open(path, _FOLDER | _NOFOLLOW)
    except OSError:
        return
    try:
        s = os.fstat(fd)
        if s.st_uid == os.geteuid() and s.st_mode & 0o077:
            os.fchmod(fd, stat.S_IMODE(s.st_mode) & 0o700)
    finally:
        os.close(fd)


def why_unsafe(path: Path) -> str | None:
    """Why loading code from the folder `path` is not safe (see open_folder); None: it is."""
    try:
        os.close(open_folder(path))
    except OSError as e:
        return str(e)
    return None


def _check(s: os.stat_result, kind) -> None:
    """Raise unless `s` is of `kind`, this user's own and private."""
    if not kind(s.st_mode):
        raise PermissionError("not a regular file or folder (a link?)")
    if s.st_uid != os.geteuid():
        raise PermissionError(f"owned by uid {s.st_uid}, not {os.geteuid()}")
    if s.st_mode & 0o077:
        raise PermissionError(f"mode {stat.S_IMODE(s.st_mode):04o}, open to others")


def _read_private(d: int, name: str) -> bytes:
    """The bytes of the file `name` in the folder `d`, checked on the descriptor read."""
    fd = os.open(name, _FILE, dir_fd=d)
    with os.fdopen(fd, "rb") as f:
        _check(os.fstat(fd), stat.S_ISREG)
        return f.read()


def _listing(d: int, manifests: bool = False) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of the executables and temporary files in the folder `d` (and the
    manifests, if asked)."""
    ends = (SUFFIX, ".json") if manifests else (SUFFIX,)
    found = []
    with os.scandir(d) as entries:
        for entry in entries:
            if entry.name.endswith(ends) or entry.name.startswith(TEMPORARY):
                with contextlib.suppress(OSError):
                    found.append((entry.name, entry.stat(follow_symlinks=False)))
    return found


def _stale(s: os.stat_result) -> bool:
    return time.time() - s.st_mtime > STALE


def _write(d: int, name: str, data: bytes) -> None:
    """Write the file `name` in the folder `d` atomically (a temporary file renamed into
    place), 0600."""
    tmp = TEMPORARY + secrets.token_hex(8)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=d)
        raise


def _pack(key: str, *parts: bytes) -> bytes:
    body = MAGIC + b"".join(struct.pack("<Q", len(p)) + p for p in (key.encode(), *parts))
    return body + hashlib.sha256(body).digest()


def _unpack(data: bytes) -> tuple[str, bytes, bytes]:
    """(key, payload, pickled trees) of a stored file; unpickles nothing."""
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
    return parts[0].decode(), parts[1], parts[2]


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


def jax_options() -> str:
    """The JAX_OPTIONS as they are now, on this thread (a `with jax.default_matmul_precision`
    block counts)."""
    return " ".join(f"{n}={getattr(jax.config, n)}" for n in JAX_OPTIONS if hasattr(jax.config, n))


def fingerprint(kernel_variant: str | None, cpu_flags) -> str:
    """What besides the program's own key decides its executable: the code, jax and its
    options, the devices and the host (XLA:CPU compiles for the host's instruction set)."""
    import jaxlib

    backend = jax.devices()[0].client
    devices = jax.devices()
    env = {k: os.environ.get(k, "") for k in ("XLA_FLAGS", "JAXINFER_CPU_KERNELS",
                                              "JAXINFER_KERNELS", "LIBTPU_INIT_ARGS")}  # fmt: skip
    return "\n".join(
        [
            f"jaxinfer sources {_sources_digest()}",
            f"jax {jax.__version__} jaxlib {jaxlib.__version__}",
            f"jax options {jax_options()}",
            f"backend {backend.platform} {backend.platform_version}",
            f"devices {len(devices)} x {devices[0].device_kind}; process "
            f"{jax.process_index()} of {jax.process_count()}",
            f"host {platform.machine()} cpu flags {' '.join(sorted(cpu_flags))}",
            f"kernels {kernel_variant}",
            *(f"env {k}={v}" for k, v in env.items()),
        ]
    )
