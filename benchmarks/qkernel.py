"""The quantized matmul kernel (jaxinfer/kernels/cpu/), with float and with 8-bit activations,
against float32 weights and in-graph dequantize + dot: one jitted chain of 24 products over
alternating [2048, 768] / [768, 2048] weights (86M-model shapes), M activation rows. Medians
of N calls, variants interleaved. Writes benchmarks/results/qkernel.md.
Usage: python benchmarks/qkernel.py [-n 15] [--quick]
"""

import functools
import os

import harness
import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxinfer.formats.gguf import split_blocks
from jaxinfer.kernels import cpu as qkernel
from jaxinfer.ops import quant

SHAPES = [(2048, 768), (768, 2048)] * 12  # [O, I] of the chain's 24 weights
KERNEL_FORMATS = ("q8_0", "q4_k", "q6_k", "q4_0")

# Measured while building the kernel (C++ harness on the kernel's loops, one core, a
# [2048, 768] weight from DRAM, unless said otherwise); kept with the results.
FINDINGS = """
## Findings from building it

- **Decode is a stream; keep it one.** One weight row at a time reads all rows as one
  sequential stream: q8_0 at M = 1 ran 14 GB/s per core, two adjacent rows interleaved 7 GB/s.
  Software prefetch 1 KiB ahead of every part's stream: 10.5 -> 15 GB/s (512 B to 4 KiB
  ahead: the same). At M = 2..8 two rows per tile, from the two halves of the row range (two
  streams): q8_0 M = 2 at 120 us vs 200 us with adjacent rows.
- **Load x once per register at M > 1.** gcc folds the x load into every FMA; at one 512-bit
  load per cycle the loads set the pace: q8_0 M = 8 went 581 -> 378 us after an empty asm
  pins x in a register for both weight rows.
- **XLA's intra-op pool, but one task fewer than its threads.** The caller plus num_threads
  tasks (3 threads on 2 cores): 2.7-3.5 ms per q8_0 chain at M = 1; caller plus
  num_threads - 1: 1.7-1.8 ms; caller alone 3.2 ms; a std::thread pool of our own spinning
  50 us between calls: 1.8-2.3 ms (2 cores, whole chain).
- **Arithmetic, not bytes, bounds the 4- to 6-bit formats at M = 1 on one core:** q4_k and
  q6_k read 1.4-1.8x fewer bytes than q8_0 but take as long. Q6_K assembles 64 values at a
  time with byte operations (25% faster than per 16 in 32-bit lanes).
- **One-row products apply the scales once per block** (`dot()`: Q8_0, Q4_0/1, Q5_0/1, Q4_K,
  Q5_K): sum_b d_b (q_b . x_b) plus the mins (or Q4_0's -8 d) times x's sums per block,
  computed once per call. The levels q convert exactly to floats, and each 16 bytes of
  nibbles widen once for both halves, where the tiles looked every 16 values up in a
  16-entry table per sub-block (vpermps) that they first had to build. A cache-resident q4_k
  matvec: 1.38 -> 1.02 ns per 16 values (with each nibble half widened on its own,
  1.13). 86M decode, old and new kernel switched at run time in one process, 12 rounds:
  Q4_K_M 1.23x, Q5_K_M 1.27x, Q8_0 1.17x, Q4_0 1.05x, greedy tokens unchanged. Error: 3e-8 of
  the sum of |terms| (test bound 1e-5). Q6_K (one scale per 16 values) gains nothing this
  way; integer products of its scales and values (vpmulld / vpmullw) 1.06x: not taken.
- **Unpacking a whole weight in the kernel for XLA's dot** (prompt chunks past MAX_ROWS,
  bit-equal to the in-graph dequantize): 86M pp512 Q8_0 0.93x, Q4_K 1.00x, and at 32 / 128
  rows against the kernel's tiles 0.98x: at 512 rows XLA's dot hides the in-graph
  dequantization (the crossover table above). Not taken.
- **Tried, no gain:** two accumulator sets per row at M = 1; converting per-block f16 scales
  16 blocks at a time (slightly slower); broadcasting K-quant scales from memory instead of
  registers; four weight rows per tile for M > 8 (slower); 1, 2 or 8 chunks of rows per
  thread instead of 4 (within noise).
- **In-graph dequantize + dot costs 47-150 ms per chain even at M = 1**: XLA materializes
  every weight as float32 before its dot. Above M = 8 the kernel dequantizes each row pair
  once into a buffer and runs float tiles over blocks of x that stay in L2; its cost then
  grows like XLA's float32 dot (1.1-1.3x its time per row), so in-graph overtakes it only at
  a few hundred rows.
"""


def random_weight(fmt: str, shape, rng) -> quant.QArray:
    """Random GGUF blocks with small f16 scales (values ~ N(0, 1/I)-sized)."""
    name = quant.FORMATS[fmt].ggml
    rows, width = shape
    bs, ts = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    raw = rng.integers(0, 256, (rows, width // bs, ts), dtype=np.uint8)
    at = (208,) if name == "Q6_K" else (0, 2) if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else (0,)
    scale = 1 / (np.sqrt(width) * {"Q8_0": 64, "Q6_K": 32 * 64}.get(name, 8))
    for i in at:
        d = rng.uniform(0.5, 1.5, (rows, width // bs, 1)) * scale
        raw[..., i : i + 2] = d.astype(np.float16).view(np.uint8)
    hq = split_blocks(name, raw.reshape(rows, -1), shape)
    return quant.QArray({k: jnp.asarray(v) for k, v in hq.take().items()}, fmt, width)


def chain(product):
    """jit(x [M, 768], weights) -> the 24-product chain, RMS-normalized between products so
    values stay normal (denormals would time something else)."""

    def run(x, weights):
        for w in weights:
            x = product(x, w)
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
        return x

    return jax.jit(run)


def dense(x, w):
    return jnp.einsum("MI,OI->MO", x, w)


def kernel(x, w):
    return qkernel.matmul(x, w.fmt, w.parts, w.shape[0])


def kernel_int8(x, w):  # activations quantized to 8 bits, integer products
    return qkernel.matmuls(x, w.fmt, [w.parts], [w.shape[0]], int8=True)[0]


def in_graph(x, w):
    return jnp.einsum("MI,OI->MO", x, quant.dequantize(w))


def time_variants(variants: dict, m: int, calls: int, rng) -> dict[str, float]:
    """Median ms per call of each (fn, weights), calls interleaved round-robin."""
    x = jnp.asarray(rng.standard_normal((m, SHAPES[0][1]), np.float32))

    def ms(fn, ws):
        return 1e3 * harness.seconds(lambda: fn(x, ws).block_until_ready())

    tests = {k: functools.partial(ms, fn, ws) for k, (fn, ws) in variants.items()}
    runs = harness.interleaved(tests, calls)  # the first round compiles and warms
    return {k: harness.stat(v).median for k, v in runs.items()}


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("-n", type=int, default=15, help="calls per variant (median)")
    ap.add_argument("--quick", action="store_true", help="main table only, no crossover sweep")
    args = ap.parse_args()
    if not qkernel.available():
        raise SystemExit(f"no CPU kernels here: {qkernel.status().describe()}")
    load_start = os.getloadavg()[0]
    rng = np.random.default_rng(0)
    f32 = [jnp.asarray(rng.standard_normal(s, np.float32) / np.sqrt(s[1])) for s in SHAPES]
    q = {f: [random_weight(f, s, rng) for s in SHAPES] for f in KERNEL_FORMATS}
    nbytes = {"f32": sum(w.nbytes for w in f32)}
    nbytes.update({f: sum(w.nbytes for w in ws) for f, ws in q.items()})
    run_dense, run_kernel, run_in_graph = chain(dense), chain(kernel), chain(in_graph)
    run_int8 = chain(kernel_int8)

    main_ms = (1, 4, 8)
    rows = [
        "| weights | path | " + " | ".join(f"M={m} ms | GB/s" for m in main_ms) + " |",
        "|---|---|" + "---:|---:|" * len(main_ms),
    ]
    table: dict[tuple[str, str], list[float]] = {}
    for m in main_ms:
        variants = {("f32", "XLA dot"): (run_dense, f32)}
        variants.update({(f, "kernel"): (run_kernel, q[f]) for f in KERNEL_FORMATS})
        variants.update({(f, "kernel int8"): (run_int8, q[f]) for f in KERNEL_FORMATS})
        variants.update({(f, "in-graph"): (run_in_graph, q[f]) for f in ("q8_0", "q4_k")})
        for k, ms in time_variants(variants, m, args.n, rng).items():
            table.setdefault(k, []).append(ms)
        print(m, {k: round(v[-1], 2) for k, v in table.items()}, flush=True)
    for (f, path), ms in table.items():
        cells = " | ".join(f"{t:.2f} | {nbytes[f] / t / 1e6:.1f}" for t in ms)
        rows.append(f"| {f} | {path} | {cells} |")

    sweep, wins, prev = [], {}, 0
    if not args.quick:
        sweep_ms = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
        sweep = [
            "| M | f32 XLA dot | "
            + " | ".join(f"{f} kernel | {f} in-graph" for f in KERNEL_FORMATS)
            + " |",
            "|---:|---:|" + "---:|---:|" * len(KERNEL_FORMATS),
        ]
        for m in sweep_ms:
            variants = {"f32": (run_dense, f32)}
            for f in KERNEL_FORMATS:
                variants[f, "k"] = (run_kernel, q[f])
                variants[f, "g"] = (run_in_graph, q[f])
            t = time_variants(variants, m, args.n, rng)
            cells = " | ".join(f"{t[f, 'k']:.2f} | {t[f, 'g']:.2f}" for f in KERNEL_FORMATS)
            sweep.append(f"| {m} | {t['f32']:.2f} | {cells} |")
            print(sweep[-1], flush=True)
            for f in KERNEL_FORMATS:
                if t[f, "k"] < t[f, "g"] and wins.get(f, 0) == prev:
                    wins[f] = m
            prev = m

    load = os.getloadavg()[0]
    note = (
        f"jax {jax.__version__} (the CPU: the last line); one jitted chain of 24 "
        f"products over alternating [2048, 768] / [768, 2048] weights, M activation rows; "
        f"median ms per chain of {args.n} calls, variants interleaved; GB/s = the format's "
        f"own bytes ({', '.join(f'{k} {v / 1e6:.0f} MB' for k, v in nbytes.items())}) / time. "
        f"Load average {load_start:.1f} before, {load:.1f} after (a shared machine: other "
        f"processes' load moves these figures by up to 2x)."
    )
    ratio = ", ".join(f"{f} {table[f, 'kernel'][1] / table[f, 'kernel'][0]:.2f}x" for f in q)
    gain = ", ".join(
        f"{f} " + " / ".join(f"{k / i:.2f}x" for k, i in
                             zip(table[f, "kernel"], table[f, "kernel int8"], strict=True))
        for f in q
    )  # fmt: skip
    text_ratio = (f"Kernel M=4 / M=1 time: {ratio}. 8-bit activations' speed-up over float "
                  f"activations (M = {', '.join(map(str, main_ms))}): {gain}.")  # fmt: skip
    used = f"CPU kernels: {qkernel.status().describe()} (JAXINFER_CPU_KERNELS forces one)."
    text = (
        f"# Quantized matmul kernel\n\n{used} {note}\n\n" + "\n".join(rows) + f"\n\n{text_ratio}\n"
    )
    if sweep:
        text += (
            "\n## Crossover: kernel vs in-graph dequantize + dot (ms per chain)\n\n"
            + "\n".join(sweep)
            + "\n\nKernel faster than in-graph for every M up to: "
            + ", ".join(f"{f} {wins.get(f, 0)}" for f in KERNEL_FORMATS)
            + f" (qkernel.MAX_ROWS = {qkernel.MAX_ROWS}).\n"
        )
    text += FINDINGS
    print(text)
    harness.write_result("qkernel", text, args.out)


if __name__ == "__main__":
    main()
