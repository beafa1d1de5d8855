"""Shared fixtures: 8 fake CPU devices, the real tiny models, engines loaded once per session."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAXINFER_COMPILE_CACHE_DIR" not in os.environ:  # keep the user's cache dir out of tests
    import tempfile

    os.environ["JAXINFER_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxinfer-xla-")

import threading  # noqa: E402
from collections import OrderedDict, namedtuple  # noqa: E402

import pytest  # noqa: E402
from support import families  # noqa: E402
from support.compiles import CompileCounter  # noqa: E402
from support.models import model_path  # noqa: E402

Tiny = namedtuple("Tiny", "path config weights")
ENGINES_KEPT = 12  # engines the session cache holds at once (least recently used go first)


@pytest.fixture(scope="session")
def stories_gguf():
    import jaxinfer

    return jaxinfer.load(model_path("stories260K-gguf/stories260K.gguf"), max_seq_len=512)


@pytest.fixture(scope="session")
def stories_hf():
    import jaxinfer

    return jaxinfer.load(model_path("stories260K-hf-derived"))


@pytest.fixture
def compiles():
    """`with compiles() as seen:` counts the XLA compiles jax.monitoring reports inside."""
    return CompileCounter


@pytest.fixture(scope="session")
def engines():
    """`engines(model, **options)`: jaxinfer.load, cached for the session by its arguments.
    For tests that only read an engine (generate, logits, their own results); tests that change
    one (strict mode after warmup, reshard, clearing its compile cache, perf counters they
    assert on) load their own. Engines with the same shapes also share compiled programs
    through the session's executable store."""
    import jaxinfer

    cache: OrderedDict = OrderedDict()

    def get(model=None, **options):
        key = (str(model), tuple(sorted((k, repr(v)) for k, v in options.items())))
        if key not in cache:
            cache[key] = jaxinfer.load(model, **options)
            while len(cache) > ENGINES_KEPT:
                cache.popitem(last=False)
        cache.move_to_end(key)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """`tiny(family, fmt="hf", seed=0, mtp=False, **write options)` -> Tiny(path, config,
    weights): a tiny random checkpoint of a family (support/families.py), written once per
    session."""
    written: dict = {}
    weights: dict = {}

    def get(family: str, fmt: str = "hf", seed: int = 0, mtp: bool = False, **kw) -> Tiny:
        key = (family, fmt, seed, mtp, tuple(sorted(kw.items())))
        if key not in written:
            wkey = (family, seed, mtp)
            if wkey not in weights:
                extra = {"mtp": True} if mtp else {}
                weights[wkey] = families.random_weights(family, seed, **extra)
            name = "-".join(map(str, (family, fmt, seed, mtp, *sorted(kw.values()))))
            folder = tmp_path_factory.mktemp(name)
            path = folder / "model.gguf" if fmt == "gguf" else folder / "hf"
            families.write(path, family, weights[wkey], fmt, **kw)
            written[key] = Tiny(path, families.FAMILIES[family], weights[wkey])
        return written[key]

    return get


@pytest.fixture
def compiled(monkeypatch):
    """The name of the thread of each grammar compile (each llguidance matcher made from a
    grammar; copies are not compiles), counted as they pass through to llguidance."""
    import llguidance

    real, names = llguidance.LLMatcher, []

    class Counting:
        grammar_from_json_schema = staticmethod(real.grammar_from_json_schema)
        grammar_from_regex = staticmethod(real.grammar_from_regex)
        grammar_from_lark = staticmethod(real.grammar_from_lark)

        def __new__(cls, *args, **kwargs):
            names.append(threading.current_thread().name)
            return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting)
    return names


@pytest.fixture
def serve_options(monkeypatch):
    """`serve_options(*flags)`: the ServerOptions `jaxinfer serve FLAGS` makes (its Server
    stands in: nothing listens or loads)."""
    from jaxinfer import cli
    from jaxinfer.serve import server as server_module

    seen = {}

    class Fake:
        def __init__(self, load, options, **kw):
            seen["options"] = options
            self.url = "http://fake"

        def run(self):
            pass

    monkeypatch.setattr(server_module, "Server", Fake)

    def options(*flags: str):
        assert cli.main(["serve", "--port", "0", *flags]) == 0
        return seen["options"]

    return options
