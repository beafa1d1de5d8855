"""`jaxinfer bench`: llama-bench style prompt (ppP) and decode (tgN) throughput.

Each combination of the comma lists is one row: one warm-up, then r timed repeats (wall
clock, mean ± std). At depth d (`-d`, llama-bench's) a test runs after d tokens in the context,
whose own prefill is not timed: pp's depth is served by the prefix cache, tg's prefill time is
taken out by the engine's own clock. Graph reuse OFF rebuilds every program on every call
(re-trace, re-lower, compile; XLA may still serve the executable from the persistent cache).
Decode rows carry MBU: (weight bytes + KV bytes read per step) x steps/s over the memory
bandwidth; an MoE step reads the experts its tokens route to, not all of them.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ..engine import Engine
from ..errors import JaxinferError


@dataclass
class BenchRow:
    model: str
    size: str  # weight bytes, llama-bench style ("1.00 MiB")
    params: str  # "260.03 K"
    backend: str
    devices: int
    layout: str
    test: str  # "pp512" / "tg128"
    graph_reuse: bool
    slots: int
    avg_ts: float
    stddev_ts: float
    mbu: float | None  # decode only
    compile_seconds: float
    recompiles_same: int
    recompiles_diff: int

    @property
    def ts(self) -> str:
        return f"{self.avg_ts:.2f} ± {self.stddev_ts:.2f}"


# the perf counters a row sums over its repeats
COUNTED = ("compile_seconds", "recompiles_same", "recompiles_diff")


def measure_bandwidth(n_bytes: int = 256 * 2**20, calls: int = 1) -> float:
    """Device memory bandwidth in bytes/s from a copy kernel (read + write), median of 5;
    `calls` copies queued before one wait (more: no dispatch and wait per copy in the time)."""
    x = jnp.zeros(n_bytes // 4, jnp.float32)
    copy = jax.jit(lambda a: a + 1.0)
    copy(x).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready([copy(x) for _ in range(calls)])
        times.append(time.perf_counter() - t0)
    return 2 * n_bytes * calls / statistics.median(times)


def _human(n: float, units: tuple[str, ...], base: float) -> str:
    for unit in units[:-1]:
        if abs(n) < base:
            return f"{n:.2f} {unit}"
        n /= base
    return f"{n:.2f} {units[-1]}"


def weight_bytes(engine: Engine) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.params))


def weight_bytes_read(engine: Engine, rows: int) -> float:
    """Weight bytes one decode step of `rows` tokens reads: all of a dense model; of an MoE
    layer's experts, the E (1 - (1 - k/E)^rows) distinct ones uniform routing reaches."""
    total = weight_bytes(engine)
    cfg = engine.cfg
    if not cfg.moe:
        return total
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.n_layers))
    experts = (
        moe_layers * 3 * cfg.d_model * cfg.d_ff_expert * cfg.n_experts * (total / cfg.n_params())
    )
    unread = (1 - cfg.n_experts_used / cfg.n_experts) ** rows
    return total - experts * unread


def _ids(n: int, r: int) -> list[int]:
    """Row r's n prompt ids: BOS, then ids that differ from row to row."""
    return [1] + [3 + (7 * i + r) % 250 for i in range(n - 1)]


def _timed(engine: Engine, test: str, n: int, slots: int, depth: int = 0) -> tuple[float, int]:
    """(seconds, tokens) of one run of the test, after `depth` tokens in the context (as
    llama-bench's -d: the depth's own prefill is not timed)."""
    kw: dict[str, Any] = dict(temperature=0, ignore_eos=True)
    one = slots == 1
    if test == "pp":
        prompts = [_ids(depth + n, r) for r in range(slots)]
        engine.reset_prefix_cache()  # every run computes the whole prompt, as llama-bench's
        if depth:  # the depth's pages in the prefix cache: the timed call computes n tokens
            engine.generate([p[:depth] for p in prompts] if not one else prompts[0][:depth],
                            max_new_tokens=1, **kw)  # fmt: skip
        t0 = time.perf_counter()
        out = engine.generate(prompts if not one else prompts[0], max_new_tokens=1, **kw)
        seconds = time.perf_counter() - t0
        cached = sum(r.cached_tokens for r in (out if not one else [out]))
        if cached != depth * slots:
            raise JaxinferError(f"pp{n} at depth {depth}: {cached} of the {depth * slots} depth "
                                "tokens were cached; the depth must be a multiple of the page "
                                "size, with the prefix cache on")  # fmt: skip
        return seconds, n * slots
    prompts = [_ids(depth + 2, r) for r in range(slots)]
    engine.reset_perf()
    t0 = time.perf_counter()
    engine.generate(prompts if not one else prompts[0], max_new_tokens=n + 1, **kw)
    # the prompt's prefill made the first token: it and its time are out of the figure
    return time.perf_counter() - t0 - engine.perf_stats().prompt_ms / 1e3, n * slots


def run_bench(
    make_engine,
    *,
    prompts: list[int],
    gens: list[int],
    repeats: int,
    depths: Sequence[int] = (0,),
    layouts: list[str],
    devices: list[int | None],
    slots: list[int],
    graph_reuse: list[bool],
    mem_bw: float | None = None,
    progress=None,
) -> list[BenchRow]:
    """`make_engine(layout, devices, slots, graph_reuse, max_seq_len)` builds each engine."""
    bandwidth = mem_bw or measure_bandwidth()
    each = [("pp", p) for p in prompts if p > 0] + [("tg", n) for n in gens if n > 0]
    tests = [(t, n, d) for d in depths for t, n in each]
    need = max(d + max([p + 1 for p in prompts] + [n + 3 for n in gens]) for d in depths)
    rows = []
    for layout, dev, n_slots, reuse in itertools.product(layouts, devices, slots, graph_reuse):
        engine = make_engine(layout, dev, n_slots, reuse, need)
        wbytes = weight_bytes(engine)
        for test, n, depth in tests:
            _timed(engine, test, n, n_slots, depth)  # warm-up: compiles what the test uses
            counts: Counter[str]
            rates, counts = [], Counter()
            for _ in range(repeats):
                engine.reset_perf()  # per repeat: _timed reads the prompt's time
                seconds, tokens = _timed(engine, test, n, n_slots, depth)
                rates.append(tokens / seconds)
                stats = engine.perf_stats()
                counts.update({k: getattr(stats, k) for k in COUNTED})
            mbu = None
            if test == "tg":
                # KV read per step: the live positions, on average the prompt + n / 2.
                kv_stats = engine.kv_stats()
                per_token = kv_stats["bytes_allocated"] / (
                    (kv_stats["pages_total"] + 1) * kv_stats["page_size"]
                )
                kv = per_token * (depth + 2 + n / 2) * n_slots
                steps = statistics.mean(rates) / n_slots
                mbu = (weight_bytes_read(engine, n_slots) + kv) * steps / bandwidth
            rows.append(
                BenchRow(
                    model=engine.cfg.name or engine.name,
                    size=_human(wbytes, ("B", "KiB", "MiB", "GiB"), 1024),
                    params=_human(engine.cfg.n_params(), ("", "K", "M", "B"), 1000),
                    backend=jax.default_backend().upper(),
                    devices=engine.mesh.devices.size,
                    layout=engine.layout,
                    test=f"{test}{n}" + (f" @ d{depth}" if depth else ""),
                    graph_reuse=reuse,
                    slots=n_slots,
                    avg_ts=statistics.mean(rates),
                    stddev_ts=statistics.stdev(rates) if len(rates) > 1 else 0.0,
                    mbu=mbu,
                    **{k: counts[k] for k in COUNTED},
                )
            )
            if progress:
                progress(rows[-1])
        del engine
    return rows


def render(rows: list[BenchRow], fmt: str) -> str:
    if fmt == "json":
        return json.dumps([asdict(r) | {"t/s": r.ts} for r in rows], indent=2)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        for r in rows:
            writer.writerow(asdict(r))
        return out.getvalue()
    extra = []
    if len({r.graph_reuse for r in rows}) > 1:
        extra.append(("graph reuse", lambda r: "on" if r.graph_reuse else "off"))
    if len({r.slots for r in rows}) > 1:
        extra.append(("slots", lambda r: str(r.slots)))
    head = ["model", "size", "params", "backend", "devices", "layout"]
    head += [name for name, _ in extra] + ["test", "t/s", "MBU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.model, r.size, r.params, r.backend, str(r.devices), r.layout]
        cells += [get(r) for _, get in extra]
        cells += [r.test, r.ts, f"{r.mbu:.1%}" if r.mbu is not None else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
