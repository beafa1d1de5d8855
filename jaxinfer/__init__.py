"""jaxinfer: a JAX/XLA compiled inference stack for Llama- and Qwen-family decoders.

The public names load lazily (PEP 562 `__getattr__`), on first use: `jaxinfer --help` imports
this package and must not import jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import ModelConfig
    from .engine import Engine, PlannedProgram
    from .errors import (
        CheckpointError,
        JaxinferError,
        LayoutError,
        RecompileError,
        RequestError,
        UnsupportedModelError,
    )
    from .loader import generate, load
    from .options import EngineOptions, SamplingParams, ServerOptions
    from .runtime.compile import RecompileEvent
    from .runtime.perf import PerfStats
    from .runtime.request import Request, Result, StreamPiece, TokenLogprob

_SOURCES = {  # public name -> the submodule that defines it
    "CheckpointError": "errors",
    "Engine": "engine",
    "EngineOptions": "options",
    "JaxinferError": "errors",
    "LayoutError": "errors",
    "ModelConfig": "config",
    "PerfStats": "runtime.perf",
    "PlannedProgram": "engine",
    "RecompileError": "errors",
    "RecompileEvent": "runtime.compile",
    "Request": "runtime.request",
    "RequestError": "errors",
    "Result": "runtime.request",
    "SamplingParams": "options",
    "ServerOptions": "options",
    "StreamPiece": "runtime.request",
    "TokenLogprob": "runtime.request",
    "UnsupportedModelError": "errors",
    "generate": "loader",
    "load": "loader",
}
__all__ = [
    "CheckpointError",
    "Engine",
    "EngineOptions",
    "JaxinferError",
    "LayoutError",
    "ModelConfig",
    "PerfStats",
    "PlannedProgram",
    "RecompileError",
    "RecompileEvent",
    "Request",
    "RequestError",
    "Result",
    "SamplingParams",
    "ServerOptions",
    "StreamPiece",
    "TokenLogprob",
    "UnsupportedModelError",
    "generate",
    "load",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    if name not in _SOURCES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_SOURCES[name]}", __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
