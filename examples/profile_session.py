"""Profile a session: warmup plus 32 decode steps in a jax profiler trace, then a summary
read back from the trace (time per step, device share, top ops with their named scopes).

    python examples/profile_session.py [MODEL] [TRACE_DIR]
Open the trace in Perfetto (ui.perfetto.dev, the perfetto_trace.json.gz file) or TensorBoard.
"""

import sys
import tempfile

import jaxinfer
from jaxinfer.runtime.profiler import op_scopes, profile, summarize, trace_files

model = sys.argv[1] if len(sys.argv) > 1 else None
trace_dir = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="jaxinfer-trace-")

# One token per decode call, so that each of the 32 steps is one compiled call.
engine = jaxinfer.load(
    model, max_seq_len=128, prefill_buckets=(16,), batch_buckets=(1,), decode_chunk=1
)
with profile(trace_dir):
    engine.warmup(progress=False)
    engine.generate("Once upon a time", max_new_tokens=33, temperature=0, ignore_eos=True)

files = trace_files(trace_dir)
print(f"trace: {files['trace']}")
summary = summarize(trace_dir, step="decode")
print(f"decode steps: {summary['steps']}, {summary['ms_per_step']:.3f} ms per step, "
      f"device busy {summary['device_share']:.0%} of it, host the rest")  # fmt: skip
scopes = {}
for compiled in engine.compile_cache.executables("decode"):
    scopes.update(op_scopes(compiled.as_text()))
print("top ops in decode steps:")
for name, ms in summary["top_ops"]:
    print(f"  {ms:8.3f} ms  {name:40s} {scopes.get(name, '')[:70]}")
