"""Profiler sessions: a `jax.profiler` trace around a run, and a summary read back from it.

Each compiled call carries a `StepTraceAnnotation` named after its program ("prefill",
"decode", "score") with its step number; layers carry `jax.named_scope` names (`layer_3/attn`)
that reach the trace through the HLO metadata of the ops; compiles carry a trace annotation
with their program and reason. The trace opens in Perfetto or TensorBoard.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import re
from pathlib import Path

import jax

from ..errors import JaxinferError


@contextlib.contextmanager
def profile(directory: str | Path | None):
    """Trace everything inside into `directory` (None: do nothing)."""
    if directory is None:
        yield
        return
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise JaxinferError(f"cannot create profile dir {str(path)!r}: {e.strerror}") from None
    options = jax.profiler.ProfileOptions()
    # The Python tracer records every Python call (a million events in one compile) and
    # crowds out the device ops; step annotations and XLA ops are what a session needs.
    options.python_tracer_level = 0
    with jax.profiler.trace(str(path), create_perfetto_trace=True, profiler_options=options):
        yield


def trace_files(directory: str | Path) -> dict[str, Path]:
    """The newest session's files: {"xplane": ..., "trace": ... (.trace.json.gz)}."""
    sessions = sorted(Path(directory).glob("plugins/profile/*"))
    if not sessions:
        raise JaxinferError(f"no profiler session under {directory}")
    files = {}
    for f in sessions[-1].iterdir():
        if f.name.endswith(".xplane.pb"):
            files["xplane"] = f
        elif f.name.endswith(".trace.json.gz"):
            files["trace"] = f
    return files


def read_events(directory: str | Path) -> list[dict]:
    with gzip.open(trace_files(directory)["trace"]) as f:
        return json.load(f)["traceEvents"]


def op_scopes(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> op_name metadata (the named scopes) of a compiled program."""
    scopes = {}
    for m in re.finditer(r"%([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]+)\"", hlo_text):
        scopes[m.group(1)] = m.group(2)
    return scopes


def summarize(directory: str | Path, step: str = "decode", top: int = 8) -> dict:
    """Per-step wall time, the device share of it, and the top ops by time for `step` calls."""
    events = [e for e in read_events(directory) if e.get("ph") == "X"]
    steps = [e for e in events if e.get("name") == step and "step_num" in e.get("args", {})]
    ops = [e for e in events if "hlo_op" in e.get("args", {})]
    in_steps = [
        o for o in ops
        if any(s["ts"] <= o["ts"] <= s["ts"] + s["dur"] for s in steps)
    ]  # fmt: skip
    step_us = sum(s["dur"] for s in steps)
    # Ops on different threads can overlap; count each thread's busy time at most once.
    busy: collections.defaultdict[tuple, float] = collections.defaultdict(float)
    for o in in_steps:
        busy[(o.get("pid"), o.get("tid"))] += o["dur"]
    device_us = min(step_us, max(busy.values(), default=0.0))
    by_op: collections.Counter[str] = collections.Counter()
    for o in in_steps:
        by_op[o["name"]] += o["dur"]
    return {
        "steps": len(steps),
        "ms_per_step": step_us / len(steps) / 1e3 if steps else 0.0,
        "device_share": device_us / step_us if step_us else 0.0,
        "top_ops": [(name, us / 1e3) for name, us in by_op.most_common(top)],
    }
