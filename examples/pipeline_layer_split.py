"""Layer split over 4 (fake CPU) devices: one pipelined program per bucket, reused every step.

python examples/pipeline_layer_split.py [MODEL]
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jaxinfer  # noqa: E402

model = sys.argv[1] if len(sys.argv) > 1 else None
engine = jaxinfer.load(
    model, layout="layer", devices=4, max_seq_len=256, prefill_buckets=(16, 64),
    batch_buckets=(1, 4), strict=True,
)  # fmt: skip
print(f"model: {engine.name}; layout {engine.layout}, mesh {dict(engine.mesh.shape)}")
print(f"stages: {engine.runner.description}")
engine.warmup()
engine.reset_perf()
r = engine.generate("Once upon a time", max_new_tokens=48, temperature=0)
print(repr(r.text))
batch = engine.generate(["One day", "The cat", "A big dog", "Lily"], max_new_tokens=16)
print([b.text for b in batch])
print(engine.perf_stats())
