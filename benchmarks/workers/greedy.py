"""llama.cpp's greedy tokens on a GGUF, its model and context opened as peer.py opens them.

Usage: greedy.py GGUF THREADS N_CTX PROMPT_JSON N. Prints {"ids": [N token ids]}.
"""

import json
import sys

import llama_cpp as L
import numpy as np
from peer import context


def main():
    ctx, n_vocab, _ = context(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    prompt, n = json.loads(sys.argv[4]), int(sys.argv[5])
    toks, out = (L.llama_token * len(prompt))(*prompt), []
    assert L.llama_decode(ctx, L.llama_batch_get_one(toks, len(prompt))) == 0
    for _ in range(n):
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        out.append(int(logits.argmax()))
        tok = (L.llama_token * 1)(out[-1])
        assert L.llama_decode(ctx, L.llama_batch_get_one(tok, 1)) == 0
    print(json.dumps({"ids": out}))


if __name__ == "__main__":
    main()
