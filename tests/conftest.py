"""Shared fixtures: 8 fake CPU devices, the real tiny models, engines loaded once per session."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAXINFER_COMPILE_CACHE_DIR" not in os.environ:  # keep the user's cache dir out of tests
    import tempfile

    os.environ["JAXINFER_COMPILE_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxinfer-xla-")

import pytest  # noqa: E402
from support.compiles import CompileCounter  # noqa: E402
from support.models import model_path  # noqa: E402


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
