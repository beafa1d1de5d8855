"""Fit against what the process holds: the 8B real shape (Llama-3-8B's layers, 4 of 32, Q4_K_M
from llama.cpp's quantizer, realshape.py's file) started with `--fit -np 4`, each start a fresh
process (workers/fit_rss.py): its peak resident set (VmHWM, after warmup and a 512-token prompt
on every slot at once) against the plan's prediction, the resident set before `load()` plus the
plan's bytes (weights, KV pool, states, snapshots, temporaries). Rows: the memory the machine
reports (the model's whole context fits), and `--fit-memory` values that make the plan cut the
context.

Usage: python benchmarks/fit.py [--work DIR] [--memory 2300,2100]
Writes benchmarks/results/fit.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import harness
import realshape

MIB = 1 << 20


def main():
    ap = harness.parser(__doc__)
    ap.add_argument("--work", type=Path, default=Path("/tmp/jaxinfer-realshape"))
    ap.add_argument("--memory", default="2300,2100", help="--fit-memory values (MiB) to try")
    args = ap.parse_args()
    harness.require_llama_cpp()
    args.work.mkdir(parents=True, exist_ok=True)
    shape = realshape.SHAPES["llama3-8b"]
    path = realshape.files(args.work, "llama3-8b", shape, shape.layers, ["Q4_K_M"])["Q4_K_M"]
    env = harness.worker_env()
    rows = []
    for memory in [None, *(int(m) for m in args.memory.split(","))]:
        options = {"slots": 4, "compile_cache_dir": None}
        if memory is not None:
            options.update(fit_memory_mib=memory, fit_ctx=512)
        r = harness.once("fit_rss", path, json.dumps(options), env=env)
        predicted = r["base"] + r["plan"]
        rows.append(
            f"| {'reported' if memory is None else f'--fit-memory {memory}'} | {r['context']} "
            f"| {'; '.join(r['gave_up']) or '-'} | {r['base'] / MIB:.0f} | {r['plan'] / MIB:.0f} "
            f"| {predicted / MIB:.0f} | {r['peak'] / MIB:.0f} | {r['peak'] / predicted:.3f} |"
        )
        print(rows[-1], "\n ", r["summary"], "\n ", json.dumps(r["parts"]), flush=True)
    text = "\n".join([
        f"# Fit vs peak RSS ({time.strftime('%Y-%m-%d')}, {shape.title} shape, {shape.layers} "
        "layers, Q4_K_M, `--fit -np 4`, a fresh process per row)",
        "",
        "| memory planned in | context | gave up | RSS before load (MiB) | plan (MiB) "
        "| predicted peak (MiB) | measured peak (MiB) | measured / predicted |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
        *rows,
    ])  # fmt: skip
    harness.write_result("fit", text, args.out)


if __name__ == "__main__":
    main()
