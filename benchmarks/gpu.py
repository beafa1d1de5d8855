"""GPU figures: jaxinfer's kernels on (JAXINFER_KERNELS=auto) against the plain-XLA graph path
(JAXINFER_KERNELS=xla), test by test in one process, on random bf16 models.

In order of importance (OUT_DIR/gpu.md is written again after every figure, so a run cut short
keeps what it measured):
1. a Llama-3.1-8B-shape model: tg128 at 1 row on each mode's engine as soon as it loads (the
   first figures), then tg128 at 8 rows, the host share of a decode step at 1 row (a jax
   profiler trace of one tg128 per mode: the union of the device's kernel and copy intervals
   against the time per step), pp512 at 1 row, the host share at 8 rows, pp512 at 8 rows;
   decode MBU against the measured copy bandwidth;
2. the MoE expert block alone (jaxinfer.model.moe.experts, jitted in a loop, bf16 weights of
   Qwen3-30B-A3B's expert shape) against its memory-bound floor at 1 and 8 rows;
3. a Qwen3-30B-A3B-shape MoE with fewer layers (its name says how many), kernels on and off;
4. graph reuse off (every call traced again) on the Qwen2.5-1.5B shape of the baseline
   (results/gpu_NVIDIA_H200.md), then that shape kernels on and off.
Engines load with the prefix cache off: run_bench repeats the same pp prompt, and cached pages
would serve all but its last page from the second run on.
`--budget S` skips what would start too late to finish inside S seconds of this process;
`--sections` picks and orders the parts (dense,block,moe,reuse,small: the five above).
`--smoke` runs the whole flow on tiny shapes with one repeat (`JAX_PLATFORMS=cpu`, ~2 min).

Needs a CUDA jax for the real figures; never needed for the tests. benchmarks/gpu.sh runs it on
a lent GPU machine. Usage: python benchmarks/gpu.py [OUT_DIR] [-r 3] [--smoke] [--budget S]
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import platform
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import harness
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxinfer
from jaxinfer.cli.bench import BenchRow, measure_bandwidth, run_bench
from jaxinfer.kernels.backend import ENV as KERNELS_ENV
from jaxinfer.model import moe
from jaxinfer.runtime.profiler import trace_files

MODES = ("auto", "xla")  # kernels on, off
SECTIONS = ("dense", "block", "moe", "reuse", "small")  # main()'s, in their order
QWEN25_15B = jaxinfer.ModelConfig(
    arch="qwen2", d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, head_dim=128,
    d_ff=8960, vocab_size=151936, qkv_bias=True, tie_embeddings=True, max_position=4096,
    name="qwen2.5-1.5B-shape (random)",
)  # fmt: skip
LLAMA31_8B = jaxinfer.ModelConfig(
    arch="llama", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
    d_ff=14336, vocab_size=128256, rope_theta=500000.0, max_position=8192,
    name="llama-3.1-8B-shape (random)",
)  # fmt: skip
# Of Qwen3-30B-A3B's 48 layers: its load (random init, then a bf16 cast on the host) and its
# compiles must fit the run's time.
MOE_LAYERS = 6


def qwen3_30b_a3b(layers: int) -> jaxinfer.ModelConfig:
    return jaxinfer.ModelConfig(
        arch="qwen3_moe", d_model=2048, n_layers=layers, n_heads=32, n_kv_heads=4,
        head_dim=128, d_ff=6144, vocab_size=151936, qk_norm=True, rope_theta=1e6,
        n_experts=128, n_experts_used=8, d_ff_expert=768, max_position=8192,
        name=f"qwen3-30B-A3B-shape, {layers} of 48 layers (random)",
    )  # fmt: skip


@dataclass
class Plan:
    """The sizes of a run: the real one, or --smoke's tiny one."""

    dense: jaxinfer.ModelConfig = LLAMA31_8B
    moe: jaxinfer.ModelConfig = field(default_factory=lambda: qwen3_30b_a3b(MOE_LAYERS))
    small: jaxinfer.ModelConfig = QWEN25_15B
    prompt: int = 512  # ppN
    gen: int = 128  # tgN
    ctx: int = 1024  # max_seq_len
    bw_bytes: int = 1 << 30
    experts: tuple = (128, 8, 2048, 768)  # E, k, D, F of the expert block
    block_iters: int = 20  # loop iterations per timed call, two expert blocks each
    # the MoE and 1.5B models' tests after tg at one row (the dense model's: main())
    steps: tuple = (("tg", 8), ("pp", 1), ("pp", 8))
    # The least time (s) worth starting: a test on both engines, a profile, the expert block,
    # the MoE and the 1.5B models (two loads), graph reuse off (a load, two tests).
    est: dict = field(
        default_factory=lambda: dict(test=15, profile=10, block=15, moe=60, small=30, reuse_off=20)
    )


def smoke_plan() -> Plan:
    tiny = dict(
        d_model=128, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=256,
        vocab_size=512, max_position=512,
    )  # fmt: skip
    return Plan(
        dense=replace(LLAMA31_8B, **tiny, name="llama-smoke (random)"),
        moe=replace(
            qwen3_30b_a3b(1), **tiny, n_experts=16, n_experts_used=4, d_ff_expert=64,
            name="qwen3-moe-smoke (random)",
        ),  # fmt: skip
        small=replace(QWEN25_15B, **tiny, name="qwen2-smoke (random)"),
        prompt=64, gen=16, ctx=128, bw_bytes=64 << 20, experts=(16, 4, 128, 64), block_iters=2,
        steps=(("pp", 1),),
    )  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def kernels(mode: str):
    """JAXINFER_KERNELS=mode inside: jaxinfer reads it at load, and whatever traces inside (the
    first call of each program) sees it too."""
    old = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = old


# ---------------------------------------------------------------------------------------------
# the results file


class Report:
    """gpu.md, written whole again after each figure."""

    def __init__(self, path: Path, title: str, header: list[str]):
        self.path, self.title, self.header = path, title, header
        self.t0 = time.perf_counter()
        self.sections: dict[str, list[str]] = {}
        self.notes: list[str] = []

    def set(self, name: str, lines: list[str]) -> None:
        self.sections[name] = lines
        self.write()

    def note(self, text: str) -> None:
        log(text)
        self.notes.append(text)
        self.write()

    def write(self) -> None:
        elapsed = time.perf_counter() - self.t0
        text = [self.title, "", *self.header, ""]
        text += [
            f"Written {elapsed:.0f} s into gpu.py's run, {len(self.sections)} sections so far "
            "(a run cut short ends here).",
            "",
        ]
        for name, lines in self.sections.items():
            text += [f"## {name}", "", *lines, ""]
        if self.notes:
            text += ["## Notes (skipped, failed)", "", *(f"- {n}" for n in self.notes), ""]
        text.append(f"CPU: {harness.cpu()}")  # as harness.write_result, which prints each time
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_name(self.path.name + ".part")  # a kill mid-write keeps the last
        part.write_text("\n".join(text) + "\n")
        os.replace(part, self.path)


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def pct(x) -> str:
    return "" if x is None else f"{x:.1%}"


def failed(what: str, e: Exception) -> str:
    traceback.print_exc()
    return f"{what} failed: {type(e).__name__}: {str(e)[:300]}"


# ---------------------------------------------------------------------------------------------
# the engines and their rows


@dataclass
class Row:
    row: BenchRow
    mode: str
    wall: float  # seconds of the whole run_bench call: its warm-up (compiles) and repeats
    host_share: float | None  # decode: 1 - time inside compiled decode calls / decode wall


class Bench:
    def __init__(self, plan: Plan, args, bw: float, bw2: float, report: Report):
        self.plan, self.args, self.bw, self.bw2, self.report = plan, args, bw, bw2, report
        self.rows: list[Row] = []
        self.reuse_rows: list[Row] = []
        self.loads: list[list[str]] = []
        self.profiles: list[list[str]] = []

    def fits(self, what: str, seconds: float) -> bool:
        left = self.args.budget - (time.perf_counter() - self.report.t0)
        if left >= seconds:
            return True
        self.report.note(f"skipped {what}: {left:.0f} s of the budget left, needs ~{seconds} s")
        return False

    def load(self, cfg, mode: str, reuse: bool = True):
        p = self.plan
        log(f"loading {cfg.name}, kernels {mode}, graph reuse {'on' if reuse else 'off'}")
        try:
            with kernels(mode):
                t0 = time.perf_counter()
                engine = jaxinfer.load(
                    cfg, dtype="bfloat16", max_seq_len=p.ctx, batch_buckets=(1, 8),
                    kv_cache_tokens=p.ctx * 8, graph_reuse=reuse, prefix_cache=False,
                )  # fmt: skip
                seconds = time.perf_counter() - t0
        except Exception as e:  # a kernel that does not build or place: the other mode goes on
            self.report.note(failed(f"load of {cfg.name} (kernels {mode})", e))
            return None
        gib = engine.weight_bytes() / 2**30
        log(f"  loaded in {seconds:.1f} s ({gib:.2f} GiB of weights)")
        reuse_cell = "on" if reuse else "off"
        self.loads.append([cfg.name, mode, reuse_cell, f"{seconds:.1f}", f"{gib:.2f}"])
        head = ["model", "kernels", "graph reuse", "load s", "weights GiB"]
        self.report.set("Loads (random init on the device, bf16 cast on the host)",
                        table(head, self.loads))  # fmt: skip
        return engine

    def test(self, engine, mode: str, test: str, slots: int, reuse=True, repeats=None):
        """One run_bench row (its warm-up, then the repeats) under kernels `mode`."""
        if engine is None:
            return None
        n = self.plan.prompt if test == "pp" else self.plan.gen
        try:
            with kernels(mode):
                t0 = time.perf_counter()
                (row,) = run_bench(
                    lambda *_: engine, prompts=[n] if test == "pp" else [],
                    gens=[n] if test == "tg" else [], repeats=repeats or self.args.rounds,
                    layouts=["single"], devices=[None], slots=[slots], graph_reuse=[reuse],
                    mem_bw=self.bw,
                )  # fmt: skip
                wall = time.perf_counter() - t0
                stats = engine.perf_stats()
        except Exception as e:
            self.report.note(failed(f"{engine.cfg.name} {test}{n} x{slots} kernels {mode}", e))
            return None
        share = stats.host_share() if test == "tg" and stats.eval_ms else None
        log(
            f"  {row.model} kernels {mode} reuse {reuse} x{slots} {row.test}: {row.ts} t/s, "
            f"MBU {pct(row.mbu) or '-'}, host share {pct(share) or '-'}, {wall:.1f} s"
        )
        return Row(row, mode, wall, share)

    def run(self, engines: dict, test: str, slots: int, modes=MODES) -> None:
        """A test on each of `modes`' engines, one after the other."""
        for mode in modes:
            if (got := self.test(engines.get(mode), mode, test, slots)) is not None:
                self.rows.append(got)
        self.write_rows()

    def write_rows(self) -> None:
        by = {(r.row.model, r.row.slots, r.row.test, r.mode): r for r in self.rows}
        keys = dict.fromkeys((r.row.model, r.row.slots, r.row.test) for r in self.rows)
        cmp = []
        for model, slots, test in keys:
            on, off = by.get((model, slots, test, "auto")), by.get((model, slots, test, "xla"))
            ratio = f"{on.row.avg_ts / off.row.avg_ts:.2f}x" if on and off else ""
            cmp.append([
                model, str(slots), test, on.row.ts if on else "-", off.row.ts if off else "-",
                ratio, pct(on and on.row.mbu), pct(off and off.row.mbu),
            ])  # fmt: skip
        head = ["model", "slots", "test", "on t/s", "off t/s", "on / off", "MBU on", "MBU off"]
        self.report.set("Kernels on vs off", table(head, cmp))
        self.report.set("All rows", self.detail(self.rows))

    def detail(self, rows: list[Row]) -> list[str]:
        out = []
        for r in rows:
            b = r.row
            ms = 1e3 * b.slots / b.avg_ts if b.test.startswith("tg") else None
            out.append([
                b.model, b.size, b.params, r.mode, "on" if b.graph_reuse else "off",
                str(b.slots), b.test, b.ts, f"{ms:.2f}" if ms else "", pct(b.mbu),
                pct(b.mbu and b.mbu * self.bw / self.bw2), pct(r.host_share), f"{r.wall:.1f}",
                f"{b.compile_seconds:.1f}", f"{b.recompiles_same}/{b.recompiles_diff}",
            ])  # fmt: skip
        head = [
            "model", "size", "params", "kernels", "graph reuse", "slots", "test", "t/s",
            "ms/step", "MBU", "MBU (pipelined bw)", "host share", "bench s",
            "compile s (engine so far)", "recompiles same/diff",
        ]  # fmt: skip
        return table(head, out)

    # ---- the host share of a decode step, from a profiler trace

    def profile(self, engine, mode: str, slots: int) -> None:
        if engine is None:
            return
        n = self.plan.gen
        prompts = [[1, 3 + r] for r in range(slots)]
        prompt = prompts if slots > 1 else prompts[0]
        kw = dict(max_new_tokens=n, temperature=0, ignore_eos=True)
        directory = tempfile.mkdtemp(prefix="jaxinfer-gpu-profile-")
        try:
            with kernels(mode):
                engine.generate(prompt, **kw)  # compiled already; warms what the trace sees
                engine.generate(prompt, profile_dir=directory, **kw)
            busy, span, events, top, where = device_busy(directory)
        except Exception as e:
            self.report.note(failed(f"profile of {engine.cfg.name} x{slots} kernels {mode}", e))
            return
        row = next(
            (r for r in self.rows if r.row.model == engine.cfg.name and r.mode == mode
             and r.row.slots == slots and r.row.test == f"tg{n}"), None,
        )  # fmt: skip
        step_ms = 1e3 * slots / row.row.avg_ts if row else None  # unprofiled, from its row
        busy_ms = busy / n * 1e3
        self.profiles.append([
            engine.cfg.name, mode, str(slots), f"{span / n * 1e3:.3f}", f"{busy_ms:.3f}",
            pct(1 - busy / span) if span else "", f"{step_ms:.3f}" if step_ms else "",
            pct(1 - busy_ms / step_ms) if step_ms else "", pct(row and row.host_share),
            f"{events / n:.0f}", "; ".join(f"{name[:48]} {share:.0%}" for name, share in top),
        ])  # fmt: skip
        log(f"  profile kernels {mode} x{slots}: busy {busy_ms:.3f} ms/step ({where})")
        head = [
            "model", "kernels", "slots", "traced ms/step", "busy ms/step", "idle in trace",
            "wall ms/step", "idle vs wall", "host share (engine)", "device events/step", "top",
        ]  # fmt: skip
        self.report.set("Decode host share (profiler)", [
            f"One tg{n} per row under `Engine.generate(profile_dir=...)` (the jax profiler; "
            f"device events: {where}). 'busy' = the union of the device's kernel and copy "
            "intervals over the call, per decode step (the 2-token prefill included); 'idle in "
            "trace' = 1 - busy / (first to last device event); 'idle vs wall' = 1 - busy / the "
            "unprofiled ms per step of the same test in 'All rows' (the profiler slows the "
            "host side, so this is the fairer share of the time the device waits for the "
            "host); 'host share (engine)' = 1 - time inside the compiled decode calls / decode "
            "wall (PerfStats.host_share: only the host's time between calls). 'top' = the "
            "device's busiest kernels, share of all event time.",
            "",
            *table(head, self.profiles),
        ])  # fmt: skip


DERIVED_LINES = (
    "XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source code", "TensorFlow Ops",
    "Framework Ops", "Kernel Launch", "Async XLA Ops",
)  # fmt: skip


def device_busy(directory: str):
    """(busy s, span s, events, top [(name, share)], where) of the device in the newest trace
    under `directory`: the union of its events' intervals. On a GPU the device plane's stream
    lines (kernels, copies); without a device plane (CPU) XLA's worker threads."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(trace_files(directory)["xplane"]))
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    chosen = []
    for plane in planes:
        lines = list(plane.lines)
        streams = [ln for ln in lines if ln.name.startswith("Stream")]
        chosen += streams or [ln for ln in lines if ln.name not in DERIVED_LINES]
    if planes:
        where = f"{planes[0].name}, lines " + ", ".join(sorted({ln.name for ln in chosen}))
    else:
        where = "no device plane: XLA's CPU worker threads (/host:CPU, tf_XLA*)"
        host = data.find_plane_with_name("/host:CPU")
        chosen = [ln for ln in host.lines if ln.name.startswith("tf_XLA")]
    spans, by_name = [], collections.Counter()
    for ln in chosen:
        for e in ln.events:
            if e.duration_ns > 0:
                spans.append((e.start_ns, e.start_ns + e.duration_ns))
                by_name[e.name] += e.duration_ns
    if not spans:
        raise RuntimeError(f"no timed events on {where}")
    spans.sort()
    busy, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo, hi = busy + hi - lo, a, b
        else:
            hi = max(hi, b)
    busy += hi - lo
    span = max(b for _, b in spans) - spans[0][0]
    total = sum(by_name.values())
    top = [(name, ns / total) for name, ns in by_name.most_common(5)]
    return busy / 1e9, span / 1e9, len(spans), top, where[:300]


# ---------------------------------------------------------------------------------------------
# the expert block alone


def expert_block(plan: Plan, bw: float, bw2: float, report: Report, rounds: int) -> None:
    E, k, D, F = plan.experts
    keys = iter(jax.random.split(jax.random.key(0), 16))

    def normal(*shape):
        return (0.02 * jax.random.normal(next(keys), shape)).astype(jnp.bfloat16)

    # two layers' experts: consecutive blocks read different weights (not the last one's L2)
    layers = [(normal(E, F, D), normal(E, F, D), normal(E, D, F)) for _ in range(2)]
    router = normal(E, D)
    impls = [
        ("experts, kernels auto", "auto", moe.experts),
        ("experts, kernels xla", "xla", moe.experts),
        ("expert_ffn (the tile loop)", "auto", None),
    ]
    lines = []
    for rows in (1, 8):
        x = normal(rows, D)
        weights, ids = moe.route(x, router, k, True)
        valid = jnp.ones(rows, bool)
        touched = len(np.unique(np.asarray(ids)))
        nbytes = touched * 3 * D * F * 2 + 2 * rows * D * 2  # the experts it reads, x and y

        for label, mode, fn in impls:

            def looped(x, layers, route, fn=fn):
                def block(x, w):
                    if fn is None:
                        return moe.expert_ffn(x, *route, *w)
                    return fn(x, *route, *w, None)

                def body(i, x):
                    for w in layers:  # a chain: each block needs the last one's output
                        x = (x.astype(jnp.float32) + 1e-3 * block(x, w)).astype(x.dtype)
                    return x

                return lax.fori_loop(0, plan.block_iters, body, x)

            try:
                with kernels(mode):
                    run = jax.jit(looped)
                    args = (x, layers, (ids, weights, valid))
                    t0 = time.perf_counter()
                    run(*args).block_until_ready()
                    first = time.perf_counter() - t0
                    times = []
                    for _ in range(max(rounds, 3)):
                        t0 = time.perf_counter()
                        run(*args).block_until_ready()
                        times.append(time.perf_counter() - t0)
            except Exception as e:
                report.note(failed(f"expert block {label} at {rows} rows", e))
                continue
            t = statistics.median(times) / (plan.block_iters * len(layers))
            lines.append([
                str(rows), f"{touched} of {E}", f"{nbytes / 1e6:.1f}", label, f"{t * 1e6:.1f}",
                f"{nbytes / t / 1e9:.0f}", pct(nbytes / t / bw), pct(nbytes / t / bw2),
                f"{nbytes / bw2 * 1e6:.1f}", f"{first:.1f}",
            ])  # fmt: skip
            log(f"  expert block {label} x{rows}: {t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s")
            head = [
                "rows", "experts touched", "MB touched", "impl", "us per block", "GB/s",
                "of copy bw", "of pipelined bw", "floor us", "first call s",
            ]  # fmt: skip
            report.set("Expert block against its memory-bound floor", [
                "jaxinfer.model.moe.experts (on accelerators with plain weights: grouped_ffn, "
                "lax.ragged_dot) under each kernels mode, and the tile loop (expert_ffn), "
                f"jitted alone: bf16, E={E} experts, top-{k}, D={D}, F={F} (Qwen3-30B-A3B's "
                "experts in the real run), routing from a random router (moe.route) made "
                f"beforehand. Each timed call runs {plan.block_iters} x 2 blocks in a "
                "fori_loop, alternating two layers' weights (chained, so none is skipped; the "
                "next block's weights are not the last one's, in L2); XLA may hoist the sort "
                "of the fixed routing out of the loop. Bytes: the distinct experts the "
                "routing touches (3 D F bf16 each) plus x and y; floor = bytes / pipelined "
                f"copy bandwidth. Median of {max(rounds, 3)} calls after a first (compiling) "
                "call.",
                "",
                *table(head, lines),
            ])  # fmt: skip


# ---------------------------------------------------------------------------------------------


def main():
    ap = harness.parser(__doc__, 3)
    ap.add_argument("out_dir", nargs="?", type=Path, default=harness.RESULTS)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, one repeat (CPU)")
    ap.add_argument("--budget", type=float, default=float("inf"), help="seconds for this run")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="which, in this order")
    args = ap.parse_args()
    if bad := set(args.sections.split(",")) - set(SECTIONS):
        ap.error(f"--sections: {', '.join(sorted(bad))} not among {', '.join(SECTIONS)}")
    plan = smoke_plan() if args.smoke else Plan()
    if args.smoke:
        args.rounds = 1
    os.environ.setdefault("JAXINFER_COMPILE_CACHE_DIR", tempfile.mkdtemp(prefix="jaxinfer-xla-"))
    dev = jax.devices()[0]
    kind = dev.device_kind
    log(
        f"{kind} ({jax.default_backend()}), jax {jax.__version__}; "
        f"{'smoke' if args.smoke else 'full'} plan, -r {args.rounds}, budget {args.budget:.0f} s"
    )
    bw = measure_bandwidth(plan.bw_bytes)
    bw2 = measure_bandwidth(plan.bw_bytes, calls=20)  # 20 copies queued, one wait
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s (a wait per copy), {bw2 / 1e9:.0f} GB/s pipelined")
    import jaxlib

    version = getattr(dev.client, "platform_version", "?").strip()
    title = (
        f"# GPU figures: jaxinfer's kernels on (JAXINFER_KERNELS=auto) vs off (xla), {kind} "
        f"({time.strftime('%Y-%m-%d')})"
    )
    header = [
        f"{kind}, {jax.default_backend()} backend ({version}); jax {jax.__version__}, jaxlib "
        f"{jaxlib.__version__}, Python {platform.python_version()}. "
        f"`benchmarks/gpu.py{' --smoke' if args.smoke else ''} -r {args.rounds}` (run by "
        f"benchmarks/gpu.sh). Random bf16 weights; max_seq_len {plan.ctx}, batch buckets "
        f"(1, 8), a KV pool of 8 x {plan.ctx} tokens, prefix cache off (run_bench repeats its "
        "pp prompt: cached pages would serve all but its last page). Each test is run_bench's: "
        "a warm-up call (compiles), then the repeats, mean ± std t/s. Kernels on and off are "
        "two engines of one process, run test after test.",
        "",
        f"Copy bandwidth: {bw / 1e9:.0f} GB/s by `measure_bandwidth` ({plan.bw_bytes >> 20} "
        "MiB, a wait after each copy: the baseline's basis, and MBU's here); "
        f"{bw2 / 1e9:.0f} GB/s with 20 copies queued before one wait ('pipelined', the basis "
        "of its own MBU column). MBU = (weight bytes read per step + the KV read) x steps/s / "
        "bandwidth; an MoE step reads only the experts uniform routing reaches (cli/bench.py).",
    ]
    report = Report(args.out or args.out_dir / "gpu.md", title, header)
    report.write()
    b = Bench(plan, args, bw, bw2, report)

    def guarded(name, fn):
        try:
            fn()
        except Exception as e:  # one broken section leaves the others
            report.note(failed(f"section {name}", e))
        gc.collect()  # the engines' weights (and their host copies) go before the next section

    def model(cfg, steps, est=None):
        """tg at one row on each mode's engine as soon as it loads, then `steps`: (test,
        rows) on both engines in turn, ("profile", rows) a profiled tg on each."""
        if est is not None and not b.fits(cfg.name, est):
            return
        engines = {}
        for mode in MODES:
            engines[mode] = b.load(cfg, mode)
            b.run(engines, "tg", 1, modes=(mode,))
        for step, slots in steps:
            if step != "profile":
                if b.fits(f"{cfg.name} {step} x{slots}", plan.est["test"]):
                    b.run(engines, step, slots)
                continue
            for mode in MODES:
                if b.fits(f"the profile of {cfg.name} x{slots} kernels {mode}",
                          plan.est["profile"]):  # fmt: skip
                    b.profile(engines.get(mode), mode, slots)
        write_reuse()

    def write_reuse():
        if not b.reuse_rows:
            return
        on = [r for r in b.rows if r.row.model == plan.small.name and r.mode == "auto"]
        report.set("Graph reuse on vs off (kernels auto)", [
            "Off: every call traced, lowered and compiled again (the executable store or "
            "XLA's cache may serve the executable); one repeat. The 'on' rows come from the "
            "kernels on/off section when it ran.",
            "",
            *b.detail([r for r in on if r.row.slots == 1] + b.reuse_rows),
        ])  # fmt: skip

    def reuse_off():
        if not b.fits("graph reuse off", plan.est["reuse_off"]):
            return
        engine = b.load(plan.small, "auto", reuse=False)
        for test in ("tg", "pp"):
            if (got := b.test(engine, "auto", test, 1, reuse=False, repeats=1)) is not None:
                b.reuse_rows.append(got)
                write_reuse()

    def block():
        if b.fits("the expert block", plan.est["block"]):
            expert_block(plan, bw, bw2, report, args.rounds)

    dense_steps = [("tg", 8), ("profile", 1), ("pp", 1), ("profile", 8), ("pp", 8)]
    sections = {
        "dense": lambda: model(plan.dense, dense_steps),  # the most important figures first
        "block": block,  # the expert block alone
        "moe": lambda: model(plan.moe, plan.steps, plan.est["moe"]),
        "reuse": reuse_off,  # graph reuse off on the 1.5B shape
        "small": lambda: model(plan.small, plan.steps, plan.est["small"]),
    }
    for name in args.sections.split(","):
        guarded(name, sections[name])
    log(f"done in {time.perf_counter() - report.t0:.0f} s")
    report.write()


if __name__ == "__main__":
    main()
