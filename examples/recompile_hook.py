"""Watch recompiles: a hook sees a changed-shape recompile (a prompt bucket compiled lazily,
since no warmup ran) and same-shape ones (the compile cache cleared, so programs it held are
built again), then the perf stats count them. After `warmup()` neither would happen: warmup
compiles the whole plan, and planned compiles are not recompiles.

    python examples/recompile_hook.py [MODEL]
"""

import sys

import jaxinfer

model = sys.argv[1] if len(sys.argv) > 1 else None
engine = jaxinfer.load(model, max_seq_len=256, prefill_buckets=(16, 64), batch_buckets=(1,))


def on_recompile(event):
    kind = "changed shape" if event.shape_changed else "SAME SHAPE"
    print(f"  [{kind}] {event.program}: {event.reason} ({event.compile_seconds:.2f} s, "
          f"{event.nodes} HLO nodes, n_same={event.n_same}, n_diff={event.n_diff})")  # fmt: skip


handle = engine.on_recompile(on_recompile)
short, long = [1] * 10, [1] * 40  # prompt chunks of 16 and 64 tokens
print("request: short (first compiles: not recompiles)")
engine.generate(short, max_new_tokens=8, temperature=0)
print("request: long (a new prompt bucket)")
engine.generate(long, max_new_tokens=8, temperature=0)
print("compile cache cleared; request: short again")
engine.compile_cache.clear()
engine.generate(short, max_new_tokens=8, temperature=0)
handle.remove()
print(engine.perf_stats())
