"""Watch recompiles: a hook sees a changed-shape recompile (a new prompt bucket) and same-shape
ones (a compile cache too small to hold both buckets), then the perf stats count them.

    python examples/recompile_hook.py [MODEL]
"""

import sys

import jaxinfer

model = sys.argv[1] if len(sys.argv) > 1 else None
# Capacity 2: each request needs a prefill and a decode program, so alternating prompt
# buckets evict each other's prefill executable.
engine = jaxinfer.load(model, max_seq_len=256, prefill_buckets=(16, 64), compile_cache_size=2)


def on_recompile(event):
    kind = "changed shape" if event.shape_changed else "SAME SHAPE"
    print(f"  [{kind}] {event.program}: {event.reason} ({event.compile_seconds:.2f} s, "
          f"{event.nodes} HLO nodes, n_same={event.n_same}, n_diff={event.n_diff})")  # fmt: skip


handle = engine.on_recompile(on_recompile)
short, long = [1] * 10, [1] * 40  # prompt chunks of 16 and 64 tokens
for label, prompt in [("short", short), ("long (new bucket)", long), ("short again", short)]:
    print(f"request: {label}")
    engine.generate(prompt, max_new_tokens=8, temperature=0)
handle.remove()
print(engine.perf_stats())
