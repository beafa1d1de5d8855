"""The executable store: a second process loads every program it needs and compiles nothing;
a bad store recompiles cleanly; a changed model, dtype, layout, kernel variant or CPU never
loads another's executable.

Compiles are observed through jax.monitoring (support.compiles), not through the store's own
counters. Engines here use their own store folders (tmp_path) and small shapes.
"""

import hashlib
import json
import os
import pathlib
import pickle
import stat
import struct
import subprocess
import sys
import textwrap
import time

import jax
import pytest
from support.compiles import CompileCounter
from support.models import model_path

import jaxinfer
from jaxinfer.runtime.store import MAGIC, SUBFOLDER, SUFFIX, ExecutableStore, Usage

STORIES = "stories260K-gguf/stories260K.gguf"
SHAPES = dict(max_seq_len=128, prefill_buckets=(16,), batch_buckets=(1,))
PROMPT = "Once upon a time"

# A fresh process: compile events (jax.monitoring) while loading and from the first generate
# on, by the name of the function being compiled (jax logs it with each compile).
PROCESS = textwrap.dedent(
    """
    import json, logging, sys
    import jax
    import jaxinfer
    events, phase = {"load": [], "run": []}, ["load"]
    class Names(logging.Handler):
        def emit(self, record):
            if "Compiling" in record.getMessage():
                events[phase[0]].append(record.getMessage().split()[1])
    jax.config.update("jax_log_compiles", True)
    logging.getLogger("jax").addHandler(Names())
    counts = {"load": 0, "run": 0}
    def on(name, secs, **kw):
        if name == "/jax/core/compile/backend_compile_duration":
            counts[phase[0]] += 1
    jax.monitoring.register_event_duration_secs_listener(on)
    engine = jaxinfer.load(sys.argv[1], compile_cache_dir=sys.argv[2], max_seq_len=128,
                           prefill_buckets=(16,), batch_buckets=(1,))
    phase[0] = "run"
    ids = engine.generate("Once upon a time", max_new_tokens=40, temperature=0).token_ids
    again = engine.generate([1, 2, 3], max_new_tokens=5, temperature=0).token_ids
    s = engine.perf_stats()
    print(json.dumps(dict(ids=ids, again=again, counts=counts, names=events,
                          loaded=s.loaded, compiled=s.programs)))
    """
)


def run_process(cache_dir, env=None):
    out = subprocess.run(
        [sys.executable, "-c", PROCESS, str(model_path(STORIES)), str(cache_dir)],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing_and_gives_the_same_tokens(tmp_path):
    first = run_process(tmp_path)
    assert first["compiled"] == 4 and first["loaded"] == 0  # cache, prefill, sample, decode
    assert first["counts"]["run"] >= 4
    second = run_process(tmp_path)
    assert (second["ids"], second["again"]) == (first["ids"], first["again"])
    assert second["counts"]["run"] == 0, second["names"]["run"]
    assert second["loaded"] == 4 and second["compiled"] == 0
    # what the load itself compiles (eager ops): nothing today; at most a few small ops
    assert second["names"]["load"] == [] and second["counts"]["load"] < 10


@pytest.mark.slow
def test_another_kernel_variant_misses_the_store(tmp_path):
    """The kernel variant (JAXINFER_CPU_KERNELS) is part of the key: the scalar build's
    process compiles its own programs, and gives the same greedy tokens."""
    first = run_process(tmp_path)
    scalar = run_process(tmp_path, {"JAXINFER_CPU_KERNELS": "scalar"})
    assert scalar["loaded"] == 0 and scalar["compiled"] == 4
    assert scalar["ids"] == first["ids"]
    assert run_process(tmp_path, {"JAXINFER_CPU_KERNELS": "scalar"})["loaded"] == 4


def load(cache_dir, model=STORIES, **kw):
    return jaxinfer.load(model_path(model), compile_cache_dir=cache_dir, **{**SHAPES, **kw})


def generate(engine):
    return engine.generate(PROMPT, max_new_tokens=12, temperature=0).token_ids


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A store filled by one engine: (cache dir, that engine's tokens)."""
    cache_dir = tmp_path_factory.mktemp("store")
    engine = load(cache_dir)
    ids = generate(engine)
    assert engine.perf_stats().programs == 4
    assert len(list((cache_dir / SUBFOLDER).glob("*.jxe"))) == 4
    return cache_dir, ids


def copy_store(stored, tmp_path):
    import shutil

    cache_dir, ids = stored
    shutil.copytree(cache_dir / SUBFOLDER, tmp_path / SUBFOLDER)
    os.chmod(tmp_path / SUBFOLDER, 0o700)
    return tmp_path, ids, sorted((tmp_path / SUBFOLDER).glob("*.jxe"))


def test_a_second_engine_loads_from_the_store(stored, tmp_path):
    cache_dir, ids, files = copy_store(stored, tmp_path)
    assert stat.S_IMODE(os.stat(cache_dir / SUBFOLDER).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 for f in files)
    engine = load(cache_dir)
    events = []
    engine.on_recompile(events.append)
    with CompileCounter() as seen:
        assert generate(engine) == ids
    assert seen.n == 0 and events == []
    stats = engine.perf_stats()
    assert (stats.loaded, stats.programs, stats.recompiles_same, stats.recompiles_diff) == (
        4, 0, 0, 0,
    )  # fmt: skip
    assert "loaded = 4 executables from the store" in str(stats)
    plan = {(p.program, p.batch, p.tokens): p.source for p in engine.compile_plan()}
    assert plan[("prefill", 1, 16)] == "loaded" and plan[("score", 1, 16)] == ""


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def other_format(path):
    path.write_bytes(MAGIC.replace(b" 1", b" 0") + path.read_bytes()[len(MAGIC) :])


def garbage(path):
    path.write_bytes(b"\x80\x04not an executable" * 10)


def loose_file(path):
    os.chmod(path, 0o644)


def symlink(path):
    target = path.with_suffix(".real")
    path.rename(target)
    path.symlink_to(target)


BAD = {"truncated": truncate, "corrupt": flip, "other format": other_format,
       "garbage": garbage, "file readable by others": loose_file, "a link": symlink}  # fmt: skip


SLOW_BAD = ("other format", "garbage", "a link")  # the default tier keeps one of each kind


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.slow] if c in SLOW_BAD else []) for c in BAD]
)
def test_a_bad_file_recompiles_cleanly(stored, tmp_path, case):
    cache_dir, ids, files = copy_store(stored, tmp_path)
    for f in files:
        BAD[case](f)
    engine = load(cache_dir)
    with CompileCounter() as seen:
        assert generate(engine) == ids
    stats = engine.perf_stats()
    assert (stats.loaded, stats.programs) == (0, 4) and seen.n == 4
    assert (stats.recompiles_same, stats.recompiles_diff) == (0, 0)
    if case not in ("file readable by others", "a link"):  # the good copies replace them
        assert load(cache_dir).generate(PROMPT, max_new_tokens=12, temperature=0).token_ids == ids


def test_a_store_directory_open_to_others_is_ignored(stored, tmp_path):
    cache_dir, ids, _ = copy_store(stored, tmp_path)
    os.chmod(cache_dir / SUBFOLDER, 0o755)
    engine = load(cache_dir)
    assert generate(engine) == ids
    assert engine.perf_stats().loaded == 0
    assert len(list((cache_dir / SUBFOLDER).glob("*.jxe"))) == 4  # and nothing written there


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_file_owned_by_another_user_is_ignored(stored, tmp_path):
    cache_dir, ids, files = copy_store(stored, tmp_path)
    for f in files:
        os.chown(f, 12345, -1)
    engine = load(cache_dir)
    assert generate(engine) == ids
    assert engine.perf_stats().loaded == 0


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(dict(dtype="bfloat16"), id="dtype", marks=pytest.mark.slow),
        pytest.param(dict(layout="tensor", devices=2), id="layout"),
        pytest.param(dict(kv_cache_dtype="float16"), id="kv dtype", marks=pytest.mark.slow),
        pytest.param(dict(model="tiny-random/qwen3_moe_e8k2_bpe/model-f32.gguf"), id="model"),
    ],
)
def test_a_changed_engine_never_loads_another_ones_executable(stored, tmp_path, change):
    cache_dir, _, _ = copy_store(stored, tmp_path)
    engine = load(cache_dir, **change)
    generate(engine)
    stats = engine.perf_stats()
    assert (stats.loaded, stats.programs) == (0, 4)


def test_the_same_model_quantized_shares_only_the_pool_allocation(stored, tmp_path):
    """Q8_0 weights of the same shapes: prefill, sample and decode take other arguments
    (blocks) and compile; the program that allocates the same KV pools (float32, asked for:
    a file in blocks defaults to float16 ones) is the same and loads."""
    cache_dir, _, _ = copy_store(stored, tmp_path)
    engine = load(cache_dir, model="stories260K-gguf-quant-derived/stories260K-Q8_0.gguf",
                  kv_cache_dtype="float32")  # fmt: skip
    generate(engine)
    plan = {p.program: p.source for p in engine.compile_plan() if p.source}
    assert plan == {"cache": "loaded", "prefill": "compiled", "sample": "compiled",
                    "decode": "compiled"}  # fmt: skip


def test_other_cpu_flags_miss_the_store(stored, tmp_path, monkeypatch):
    from jaxinfer.kernels import cpu

    cache_dir, ids, _ = copy_store(stored, tmp_path)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"sse2", "avx"}))
    engine = load(cache_dir)
    assert generate(engine) == ids
    assert engine.perf_stats().loaded == 0


def test_the_store_keeps_to_its_cap_and_clears(stored, tmp_path):
    """A save past the cap drops the least recently used files (by mtime) until the store
    fits; the cap is set from the files' own sizes, which differ by CPU."""
    cache_dir, _, files = copy_store(stored, tmp_path)
    for age, f in enumerate(files):  # files[0] is the oldest
        os.utime(f, (1000 + age, 1000 + age))
    sizes = [f.stat().st_size for f in files]
    engine = load(cache_dir)
    generate(engine)  # loads (and touches) them all
    for age, f in enumerate(files):
        os.utime(f, (1000 + age, 1000 + age))
    (compiled,) = engine.compile_cache.executables("cache")
    probe = ExecutableStore(tmp_path / "probe", fingerprint=engine.compile_cache.store.fingerprint)
    assert probe.save("another key", compiled, [jax.devices()[0]])
    new_size = probe.path("another key").stat().st_size
    cap = sum(sizes) + new_size - 1  # one byte short of keeping everything
    store = ExecutableStore(cache_dir / SUBFOLDER, cap, engine.compile_cache.store.fingerprint)
    assert store.save("another key", compiled, [jax.devices()[0]])
    left = sorted((cache_dir / SUBFOLDER).glob("*.jxe"))
    assert files[0] not in left and set(files[1:]) <= set(left)  # the oldest went, only it
    assert store.path("another key") in left
    assert store.usage().bytes <= cap
    assert store.clear() == len(left) and store.usage().files == 0


def test_no_compile_cache_means_no_store(tmp_path):
    assert jaxinfer.load(model_path(STORIES), compile_cache_dir=None).compile_cache.store is None
    assert load(tmp_path, executable_store_mib=0).compile_cache.store is None
    with pytest.raises(jaxinfer.JaxinferError, match="executable_store_mib"):
        load(tmp_path, executable_store_mib=-1)


@pytest.mark.parametrize(
    "model, options",
    [
        pytest.param(
            "tiny-random/qwen3_next_l3f1_e8k2_mtp",
            dict(speculative="mtp"),
            marks=pytest.mark.slow,
            id="hybrid MoE with MTP",
        ),
        pytest.param(STORIES, dict(speculative=STORIES), marks=pytest.mark.slow, id="draft model"),
    ],
)
def test_speculative_programs_are_stored_and_loaded(tmp_path, model, options):
    """No program closes over a constant (serialize refuses them): the MTP head's and the
    draft model's programs store and load like the others."""
    if options["speculative"] == STORIES:  # resolved here: a missing model skips this test
        options = dict(speculative=str(model_path(STORIES)))
    first = load(tmp_path, model=model, **options)
    ids = generate(first)
    assert first.compile_cache.store.saved == first.perf_stats().programs == 4
    second = load(tmp_path, model=model, **options)
    with CompileCounter() as seen:
        assert generate(second) == ids
    assert seen.n == 0 and second.perf_stats().loaded == 4


def test_the_next_engine_reads_its_executables_ahead(stored, tmp_path):
    """Each engine lists what it used in its session's manifest; the next engine of the same
    model and options reads those files while its weights are placed and loads them from
    there. A manifest that is not JSON, or lists files that are not there, changes nothing."""
    cache_dir, ids, _ = copy_store(stored, tmp_path)
    first = load(cache_dir)
    assert generate(first) == ids and first.perf_stats().loaded == 4
    (manifest,) = (cache_dir / SUBFOLDER).glob("*.json")
    assert len(json.loads(manifest.read_text())) == 4
    second = load(cache_dir)
    assert len(second.compile_cache.store._pending) == 4  # being read ahead
    assert generate(second) == ids and second.perf_stats().loaded == 4
    assert second.compile_cache.store._pending == {}  # all taken
    for text in ("not json", '[["missing.jxe", [0]], ["../x.jxe", [0]]]'):
        manifest.write_text(text)
        third = load(cache_dir)
        assert generate(third) == ids and third.perf_stats().loaded == 4


def test_the_cli_shows_and_clears_the_store(tmp_path, capsys):
    from jaxinfer.cli import main

    flags = ["-m", str(model_path(STORIES)), "-c", "128", "--compile-cache-dir", str(tmp_path)]
    assert main(["generate", *flags, "-ub", "16", "-n", "4", "--temp", "0"]) == 0
    assert main(["info", *flags]) == 0
    out = capsys.readouterr().out
    assert f"executable store : {tmp_path / SUBFOLDER}: 4 executables" in out
    assert "score[B=1, T=" in out and "logits at every position" in out  # the plan, and why
    assert main(["info", *flags, "--clear-executable-store"]) == 0
    assert "cleared 4 executables" in capsys.readouterr().err
    assert main(["info", *flags, "--no-compile-cache", "--clear-executable-store"]) == 1
    assert "no compile cache dir" in capsys.readouterr().err


# ---- what is loaded, and from where ---------------------------------------------------------
# The store's own files, made here: a file under a key whose trees, if they were ever unpickled,
# would create a marker file (the code an attacker's file would run).


class Touch:
    """Unpickling this creates the file `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def stored_file(path, key, trees, mode=0o600):
    """A file in the store's layout (MAGIC, length-prefixed key, payload and pickled trees,
    the SHA-256 of all that) at `path`."""
    parts = (key.encode(), b"not an executable", trees)
    body = MAGIC + b"".join(struct.pack("<Q", len(p)) + p for p in parts)
    path.write_bytes(body + hashlib.sha256(body).digest())
    os.chmod(path, mode)


def harmful(marker):
    return pickle.dumps((Touch(marker), Touch(marker)))


def private_folder(path, mode=0o700):
    path.mkdir()
    os.chmod(path, mode)
    return path


def a_compiled_program():
    """A small executable the store can hold: x + 1 on one device."""
    return jax.jit(lambda x: x + 1).lower(jax.numpy.zeros(3)).compile()


ONE = jax.devices()[:1]


def test_the_marker_works(tmp_path):
    """The tests below rely on unpickling a planted file creating its marker."""
    marker = tmp_path / "marker"
    pickle.loads(harmful(marker))
    assert marker.exists()


def swap_folder(folder, other):
    folder.rename(folder.with_name("moved"))
    folder.symlink_to(other)


def swap_file(folder, other):
    name = next(folder.glob("*" + SUFFIX)).name
    os.replace(other / name, folder / name)


SWAPS = {  # (what is swapped, before which os.open)
    "folder for a link, before the folder opens": (swap_folder, lambda path: True),
    "folder for a link, before the file opens": (swap_folder, lambda p: str(p).endswith(SUFFIX)),
    "file for another's, before the file opens": (swap_file, lambda p: str(p).endswith(SUFFIX)),
}


@pytest.mark.parametrize("swap", SWAPS)
def test_a_swap_between_the_check_and_the_open_is_never_unpickled(tmp_path, monkeypatch, swap):
    """Another user's folder (or file) put in place between the store's checks and its open:
    their file (0644 in a 0755 folder) is not read, let alone unpickled."""
    do, when = SWAPS[swap]
    marker, key = tmp_path / "marker", "the key"
    folder, other = private_folder(tmp_path / "store"), private_folder(tmp_path / "other", 0o755)
    store = ExecutableStore(folder)
    stored_file(store.path(key), key, pickle.dumps((None, None)))
    stored_file(other / store.path(key).name, key, harmful(marker), mode=0o644)
    swapped, real_open = [], os.open

    def swap_then_open(path, *args, **kw):
        if not swapped and when(path):
            do(folder, other)
            swapped.append(path)
        return real_open(path, *args, **kw)

    monkeypatch.setattr(os, "open", swap_then_open)
    got = store.load(key, ONE)
    monkeypatch.undo()
    assert swapped and got is None
    assert not marker.exists()


def test_a_file_open_to_others_is_never_unpickled(tmp_path):
    marker, key = tmp_path / "marker", "the key"
    store = ExecutableStore(private_folder(tmp_path / "store"))
    stored_file(store.path(key), key, harmful(marker), mode=0o644)
    assert store.load(key, ONE) is None
    assert not marker.exists()


def test_a_file_of_another_key_is_never_unpickled(tmp_path):
    """Neither load() (which knows the key) nor prefetch() (which knows the file's name and
    the store's fingerprint) unpickles a file that holds another key."""
    marker = tmp_path / "marker"
    store = ExecutableStore(private_folder(tmp_path / "store"), fingerprint="env")
    wanted = "env\nprogram decode"
    stored_file(store.path(wanted), "env\nprogram prefill", harmful(marker))
    assert store.load(wanted, ONE) is None
    assert not marker.exists()
    manifest = store.directory / "session.json"
    manifest.write_text(json.dumps([[store.path(wanted).name, [d.id for d in ONE]]]))
    os.chmod(manifest, 0o600)
    store.prefetch("session")
    (early,) = store._pending.values()
    assert early.result() is None
    assert not marker.exists()


def test_a_store_in_a_folder_others_can_write_is_refused(tmp_path):
    """Another user could rename the store's folder and put theirs in its place."""
    parent = private_folder(tmp_path / "parent")
    store = ExecutableStore(parent / "executables")
    assert store.save("k", a_compiled_program(), ONE) and store.load("k", ONE) is not None
    os.chmod(parent, 0o777)
    assert store.load("k", ONE) is None
    assert not store.save("k2", a_compiled_program(), ONE)
    assert store.usage().files == 0 and store.clear() == 0


def test_a_store_in_a_sticky_folder_others_can_write_works(tmp_path):
    """A sticky folder (/tmp) lets no one rename another's folder."""
    parent = private_folder(tmp_path / "shared", 0o1777)
    assert ExecutableStore(parent / "executables").save("k", a_compiled_program(), ONE)
    store = ExecutableStore(parent / "executables")
    compiled = store.load("k", ONE)
    assert compiled is not None and store.loaded == 1
    assert compiled(jax.numpy.zeros(3)).tolist() == [1.0, 1.0, 1.0]


def test_the_persistent_cache_stays_off_in_a_folder_others_can_write(tmp_path, caplog):
    from jaxinfer.runtime.compile import use_persistent_cache

    parent = private_folder(tmp_path / "parent")
    try:
        use_persistent_cache(parent / "xla")
        assert jax.config.jax_enable_compilation_cache
        os.chmod(parent, 0o777)
        with caplog.at_level("WARNING"):
            use_persistent_cache(parent / "xla")
        assert not jax.config.jax_enable_compilation_cache
        (line,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert "writable by others" in line
    finally:
        use_persistent_cache(None)  # as every engine with a store sets it


# ---- what the key holds -------------------------------------------------------------------


def test_the_matmul_precision_is_part_of_the_fingerprint():
    from jaxinfer.runtime.store import fingerprint

    plain = fingerprint(None, {"avx"})
    with jax.default_matmul_precision("highest"):
        assert fingerprint(None, {"avx"}) != plain
    assert fingerprint(None, {"avx"}) == plain


def test_a_program_compiled_under_another_matmul_precision_is_not_loaded(tmp_path):
    """The store key holds the jax settings where the program compiles (a `with` block around
    an engine call counts), not only where the engine was loaded."""
    from jaxinfer.runtime.compile import CompileCache

    def matmul(a, b):
        return a @ b

    args = (jax.numpy.ones((4, 4)), jax.numpy.ones((4, 4)))

    def get():
        cache = CompileCache(store=ExecutableStore(tmp_path / "store", fingerprint="env"))
        context = cache.context("static", ("one", (), (ONE[0].id,), ()), [], ())
        cache.get("matmul", context, matmul, args)
        return cache.store

    with jax.default_matmul_precision("highest"):
        assert get().saved == 1
    assert get().loaded == 0
    with jax.default_matmul_precision("highest"):
        assert get().loaded == 1


# ---- temporary files ----------------------------------------------------------------------


def interrupted_write(folder, size, age):
    """A temporary file as a write leaves it, last written `age` seconds ago."""
    path = folder / f".tmp-{age}"
    path.write_bytes(b"x" * size)
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_temporary_files_are_counted_and_stale_ones_cleared(tmp_path):
    folder = private_folder(tmp_path / "store")
    stale, live = interrupted_write(folder, 1000, 3600), interrupted_write(folder, 10, 1)
    store = ExecutableStore(folder)
    assert store.usage() == Usage(files=0, bytes=1010, temporary=2)
    assert store.clear() == 0
    assert not stale.exists() and live.exists()  # another process may be writing that one


def test_a_save_drops_stale_temporary_files_and_counts_live_ones(tmp_path):
    folder = private_folder(tmp_path / "store")
    compiled = a_compiled_program()
    probe = ExecutableStore(tmp_path / "probe")
    assert probe.save("a", compiled, ONE)
    size = probe.path("a").stat().st_size  # "b"'s is the same
    store = ExecutableStore(folder, capacity=2 * size + 50)
    assert store.save("a", compiled, ONE)
    os.utime(store.path("a"), (1000, 1000))
    stale, live = interrupted_write(folder, 10, 3600), interrupted_write(folder, 100, 1)
    assert store.save("b", compiled, ONE)  # 2 executables and 100 live bytes pass the cap
    assert not stale.exists() and live.exists()
    assert not store.path("a").exists() and store.path("b").exists()
