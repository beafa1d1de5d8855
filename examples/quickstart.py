"""Load a model and generate greedily; with no argument, the built-in stories260K.

python examples/quickstart.py [MODEL] [PROMPT]
"""

import sys

import jaxinfer

model = sys.argv[1] if len(sys.argv) > 1 else None
prompt = sys.argv[2] if len(sys.argv) > 2 else "Once upon a time"

engine = jaxinfer.load(model)
print(f"model: {engine.name} [{engine.source}]")
result = engine.generate(prompt, max_new_tokens=32, temperature=0)
print(repr(prompt + result.text))
print(f"{len(result.token_ids)} tokens, finish_reason = {result.finish_reason}")
print(engine.perf_stats())
