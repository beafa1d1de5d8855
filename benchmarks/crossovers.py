"""Where a product goes to the CPU kernel rather than XLA's dot, measured per variant: the
figures behind kernels.cpu.CROSSOVERS.

Three sweeps, every variant this CPU runs (or --variants) interleaved call by call with XLA:
- float32 weights, M = 1..96 rows: the kernel's f32 tiles against XLA's dot (`float_rows`:
  the kernel wins from 2 rows up to there);
- float32 weights at one row, square weights of 128^2..2048^2 values (`one_row_values`: the
  kernel wins from there up; XLA's one-row dot is a fused matvec whose fixed cost is lower);
- Q8_0 and Q4_K weights, M = 32..768 rows: the kernel against in-graph dequantize + dot
  (`max_rows`: the kernel wins up to there).
Chains of 24 products as benchmarks/qkernel.py times them (86M shapes), compiled ahead of time
under each variant (kernels.using), median ms per chain.

Usage: python benchmarks/crossovers.py [-n 9] [--variants avx2,scalar] [--quick]
Writes benchmarks/results/crossovers.md (--quick: fewer points, prints only unless --out).
"""

from __future__ import annotations

import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import qkernel as bench

from jaxinfer.kernels import cpu as kernels
from jaxinfer.ops import quant


def compiled(product, x, ws, variant=None):
    """The chain of `product` over `ws`, compiled for x's shape (under `variant`'s kernels)."""
    fn = bench.chain(product)
    if variant is None:
        return fn.lower(x, ws).compile()
    with kernels.using(variant):
        return fn.lower(x, ws).compile()


def time_all(fns: dict, x, ws: dict, calls: int) -> dict:
    """Median ms per call of each compiled fn on (x, its weights), calls interleaved."""

    def ms(key):
        return 1e3 * harness.seconds(lambda: fns[key](x, ws[key]).block_until_ready())

    runs = harness.interleaved({k: functools.partial(ms, k) for k in fns}, calls)
    return {k: harness.stat(v).median for k, v in runs.items()}


def first_loss(points, wins) -> int:
    """The last point of the leading run of points where the kernel won (0: none)."""
    last = 0
    for p in points:
        if not wins[p]:
            break
        last = p
    return last


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("-n", type=int, default=9, help="calls per path and point (median)")
    ap.add_argument("--variants", default=",".join(kernels.runnable()))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    variants = args.variants.split(",")
    rng = np.random.default_rng(0)
    calls = 3 if args.quick else args.n
    f32 = [jnp.asarray(rng.standard_normal(s, np.float32) / np.sqrt(s[1])) for s in bench.SHAPES]

    results: dict[str, dict] = {v: {} for v in variants}
    sections = []

    def sweep(title, points, make, paths, judge):
        """One table: a row per point, a column per path; judge(point, times) -> {variant: win}."""
        names = [p if isinstance(p, str) else " ".join(p) for p in paths]
        lines = ["| " + title + " | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(paths)]
        wins = {v: {} for v in variants}
        for p in points:
            x, fns, ws = make(p)
            t = time_all(fns, x, ws, calls)
            lines.append(f"| {p} | " + " | ".join(f"{t[k]:.2f}" for k in paths) + " |")
            print(lines[-1], flush=True)
            for v, won in judge(t).items():
                wins[v][p] = won
        return lines, wins

    # float32 weights, M rows
    rows_f = (1, 2, 4, 8, 16, 32) if args.quick else (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)

    def float_paths(x, weights):
        """XLA's dot and each variant's kernel on the float32 `weights`, compiled for x."""
        wq = [quant.QArray({"w": w}, "f32", w.shape[1]) for w in weights]
        fns = {"XLA dot": compiled(bench.dense, x, weights)}
        fns.update({v: compiled(bench.kernel, x, wq, v) for v in variants})
        return x, fns, {"XLA dot": weights, **{v: wq for v in variants}}

    def make_f(m):
        return float_paths(
            jnp.asarray(rng.standard_normal((m, bench.SHAPES[0][1]), np.float32)), f32
        )

    lines, wins = sweep(
        "M (f32)", rows_f, make_f, ["XLA dot", *variants],
        lambda t: {v: t[v] < t["XLA dot"] for v in variants},
    )  # fmt: skip
    for v in variants:
        results[v]["float_rows"] = first_loss([m for m in rows_f if m >= 2], wins[v])
    sections.append("## float32 weights: kernel vs XLA's dot (ms per chain)\n\n" + "\n".join(lines))

    # float32 weights at one row, by weight size
    sizes = (256, 512, 1024) if args.quick else (128, 256, 384, 512, 768, 1024, 1536, 2048)

    def make_one(n):
        weights = [jnp.asarray(rng.standard_normal((n, n), np.float32) / np.sqrt(n))] * 24
        return float_paths(jnp.asarray(rng.standard_normal((1, n), np.float32)), weights)

    lines, wins = sweep(
        "n (one row, [n, n])", sizes, make_one, ["XLA dot", *variants],
        lambda t: {v: t[v] < t["XLA dot"] for v in variants},
    )  # fmt: skip
    for v in variants:
        won = [n for n in sizes if all(wins[v][m] for m in sizes if m >= n)]
        results[v]["one_row_values"] = won[0] ** 2 if won else None
    sections.append(
        "## float32 weights at one row: kernel vs XLA's dot (ms per chain of 24 [n, n])\n\n"
        + "\n".join(lines)
    )

    # quantized weights, M rows
    rows_q = (16, 64, 256) if args.quick else (8, 16, 32, 64, 128, 192, 256, 384, 512, 768)
    fmts = ("q8_0", "q4_k")
    q = {f: [bench.random_weight(f, s, rng) for s in bench.SHAPES] for f in fmts}

    def make_q(m):
        x = jnp.asarray(rng.standard_normal((m, bench.SHAPES[0][1]), np.float32))
        fns, ws = {}, {}
        for f in fmts:
            fns[f, "in-graph"] = compiled(bench.in_graph, x, q[f])
            ws[f, "in-graph"] = q[f]
            for v in variants:
                fns[f, v] = compiled(bench.kernel, x, q[f], v)
                ws[f, v] = q[f]
        return x, fns, ws

    paths = [(f, p) for f in fmts for p in ("in-graph", *variants)]
    lines, wins = sweep(
        "M", rows_q, make_q, paths,
        lambda t: {v: all(t[f, v] < t[f, "in-graph"] for f in fmts) for v in variants},
    )  # fmt: skip
    for v in variants:
        results[v]["max_rows"] = first_loss(rows_q, wins[v])
    sections.append(
        "## Q8_0 and Q4_K: kernel vs in-graph dequantize + dot (ms per chain)\n\n"
        + "\n".join(lines)
    )

    summary = [
        "| variant | float_rows | one_row_values | max_rows | in use (CROSSOVERS) |",
        "|---|---:|---:|---:|---|",
    ]
    for v in variants:
        r = results[v]
        summary.append(
            f"| {v} | {r['float_rows']} | {r['one_row_values']} | {r['max_rows']} | "
            f"{kernels.CROSSOVERS[v]} |"
        )
    text = (
        "# Kernel / XLA crossovers per CPU kernel variant\n\n"
        f"jax {jax.__version__}; chains of 24 products (86M shapes unless said), compiled ahead "
        f"of time under each variant, median ms per chain of {calls} calls interleaved. Each "
        "figure below is the last measured point of the leading run where the kernel won "
        "(one_row_values: the smallest size from which it won at every larger one).\n\n"
        + "\n".join(summary)
        + "\n\n"
        + "\n\n".join(sections)
        + "\n"
    )
    print(text)
    if not args.quick or args.out:
        harness.write_result("crossovers", text, args.out)


if __name__ == "__main__":
    main()
