"""The CPU kernels' variants side by side: the random 86M Llama in F32 and Q8_0, pp512 and
tg128, under each variant this CPU runs and under JAXINFER_CPU_KERNELS=off (the graph path).

The Q8_0 file is the F32 one with every 2-D weight quantized by gguf-py's Q8_0 (the reference
quantizer llama.cpp's Q8_0 also implements), written in a temporary folder. Each (variant, file)
is one worker process (workers/ours.py, timed around generate()); all of them in turn each
round, medians over the rounds after a dropped warm-up round.

Usage: python benchmarks/variants.py [-r 5] [--variants avx2,scalar,off] [--quick]
Writes benchmarks/results/variants.md (--quick: 1 round, tg32 and pp64 only, prints only
unless --out).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import harness

from jaxinfer.kernels import cpu as kernels


def quantize_q8_0(src: Path, dst: Path) -> Path:
    """`src` with every 2-D float weight whose rows are whole 32-value blocks in Q8_0."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(dst), bytes(arch.parts[arch.data[0]]).decode())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                value = [bytes(field.parts[i]).decode() for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(field.name, value)
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(field.name, bytes(field.parts[field.data[0]]).decode())
        else:
            writer.add_key_value(field.name, field.parts[field.data[0]].tolist()[0], kind)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if data.ndim == 2 and data.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(t.name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def main():
    ap = harness.parser(__doc__, rounds=5)
    ap.add_argument("--variants", default=",".join([*kernels.runnable(), "off"]))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    variants = args.variants.split(",")
    tests = {"pp64": 64, "tg32": 32} if args.quick else {"pp512": 512, "tg128": 128}
    commands = {t: {"test": t[:2], "n": n, "depth": 0} for t, n in tests.items()}
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        f32 = harness.write_random_gguf(Path(tmp) / "86m-f32.gguf", **harness.LLAMA_86M)
        files = {"F32": f32, "Q8_0": quantize_q8_0(f32, Path(tmp) / "86m-q8_0.gguf")}
        workers = {}
        for variant in variants:
            env = {**harness.worker_env(devices=1), kernels.ENV: variant}
            for label, path in files.items():
                workers[variant, label] = harness.Worker(
                    "ours", path, 1024, json.dumps({}), env=env
                )
        med = harness.run_rounds([(workers, commands)], rounds)
    names = list(workers)
    rows = [
        "| variant | file | " + " | ".join(tests) + " |",
        "|---|---|" + "---|" * len(tests),
        *(
            f"| {v} | {f} | " + " | ".join(f"{med[(v, f), t]:.1f}" for t in tests) + " |"
            for v, f in names
        ),
    ]
    ratios = ["", "| ratio | " + " | ".join(tests) + " |", "|---|" + "---|" * len(tests)]
    for v in variants:
        ratios.append(
            f"| {v}: Q8_0 / F32 | "
            + " | ".join(f"{med[(v, 'Q8_0'), t] / med[(v, 'F32'), t]:.2f}x" for t in tests)
            + " |"
        )
        if v != "off" and "off" in variants:
            for f in files:
                ratios.append(
                    f"| {f}: {v} / off | "
                    + " | ".join(f"{med[(v, f), t] / med[('off', f), t]:.2f}x" for t in tests)
                    + " |"
                )
    text = (
        "# CPU kernel variants: 86M F32 and Q8_0\n\n"
        f"{harness.cpu()}\n\n"
        f"Tokens per second, medians over {rounds} interleaved rounds after a warm-up round; "
        "each (variant, file) one process forced with JAXINFER_CPU_KERNELS "
        "(off: XLA's graph path).\n\n" + "\n".join(rows + ratios) + "\n"
    )
    print(text)
    if not args.quick or args.out:
        harness.write_result("variants", text, args.out)


if __name__ == "__main__":
    main()
