"""One `--fit` start measured against its plan: the resident set before `load()`, the plan's
bytes, and the process's peak resident set (VmHWM) after a warmup and a 512-token prompt on
every slot at once, with 16 new tokens each.

Usage: fit_rss.py GGUF OPTIONS_JSON (load()'s keywords; fit=True is added). Prints one JSON
line: {"base", "plan", "peak", "rss_after_load", "context", "gave_up", "parts"} (bytes).
"""

import json
import sys

import jax

import jaxinfer
from jaxinfer.runtime.fit import resident_bytes


def hwm() -> int:
    line = next(ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def main():
    path, options = sys.argv[1], json.loads(sys.argv[2])
    jax.numpy.zeros(1).block_until_ready()
    base = resident_bytes()
    engine = jaxinfer.load(path, fit=True, **options)
    after_load = resident_bytes()
    engine.warmup(progress=False)
    plan = engine.fit_plan
    prompts = [[1] + [3 + (7919 * i + 104729 * r) % 31000 for i in range(511)]
               for r in range(engine.slots or 1)]  # fmt: skip
    engine.generate(prompts, max_new_tokens=16, temperature=0.0, ignore_eos=True)
    print(json.dumps({
        "base": base, "plan": plan.total, "peak": hwm(), "rss_after_load": after_load,
        "context": engine.max_seq_len, "gave_up": list(plan.gave_up),
        "parts": dict(plan.rows()), "summary": plan.summary(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
