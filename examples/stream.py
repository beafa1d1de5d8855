"""Stream text as it is generated (sampled, seeded, with a stop string).

python examples/stream.py [MODEL] [PROMPT]
"""

import sys

import jaxinfer

model = sys.argv[1] if len(sys.argv) > 1 else None
prompt = sys.argv[2] if len(sys.argv) > 2 else "Once upon a time"

engine = jaxinfer.load(model)
print(prompt, end="", flush=True)
for piece in engine.generate(
    prompt, max_new_tokens=48, temperature=0.8, top_p=0.95, seed=42, stop=["\n\n"], stream=True
):
    print(piece.text, end="", flush=True)
    if piece.finish_reason:
        print(f"\n[finish_reason = {piece.finish_reason}]")
