"""llama.cpp through its C API (llama-cpp-python's ctypes bindings), run the way llama-bench runs
it: flash attention on, F16 K/V cache, n_batch = n_ubatch = 512, the same threads for batch and
generation, prompt batches through `llama_batch_get_one` (logits of the last token only), one
token per decode for generation, the cache cleared between runs, a depth prompt first.

Usage: peer.py GGUF THREADS N_CTX [KV_TYPE] (f16, llama-bench's default, or q8_0: its -ctk q8_0
-ctv q8_0). Prints {"ready": true}, then answers each JSON line
{"test": "pp" | "tg", "n": N, "depth": D} with {"ts": tokens/s by llama.cpp's own counters}.
{"test": "rss"} answers the process's peak resident bytes so far (VmHWM) as "ts".
greedy.py opens its model the same way (context()).

PEER_REPACK=0 in the environment loads without llama.cpp's extra buffer types (weights
repacked for AMX or for its interleaved CPU kernels: `use_extra_bufts`, llama-bench's
`--no-repack`) for a CPU where they crash: llama-cpp-python 0.3.36's native build on a
Sapphire Rapids VM segfaults at its first AMX product (llama.cpp#20824) and, weights forced
into CPU_REPACK instead, at load on Q5_K / Q6_K / Q8_0 tensors. A peer without them is slower
than llama-bench on prompts: say so beside its figures (results files name it).
"""

import ctypes
import json
import os
import sys

import llama_cpp as L

# kept alive for as long as the process: llama.cpp holds the pointer
QUIET = L.llama_log_callback(lambda level, text, data: None)


KV_TYPES = {"f16": 1, "q8_0": 8}  # GGML_TYPE_F16, GGML_TYPE_Q8_0


def context(path: str, threads: int, n_ctx: int, kv_type: str = "f16"):
    """(context, vocabulary size, BOS id or None) of `path` with llama-bench's settings."""
    L.llama_log_set(QUIET, ctypes.c_void_p())
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    mp.use_extra_bufts = os.environ.get("PEER_REPACK", "1") != "0"
    model = L.llama_model_load_from_file(path.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, 512, 512
    cp.n_threads = cp.n_threads_batch = threads
    cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    cp.type_k = cp.type_v = KV_TYPES[kv_type]
    cp.no_perf = False
    ctx = L.llama_init_from_model(model, cp)
    vocab = L.llama_model_get_vocab(model)
    bos = L.llama_vocab_bos(vocab) if L.llama_vocab_get_add_bos(vocab) else None
    return ctx, L.llama_vocab_n_tokens(vocab), bos


def main():
    ctx, n_vocab, bos = context(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:5])
    state = [12345]

    def rand():  # llama-bench draws std::rand() % n_vocab; any fixed stream will do
        state[0] = (1103515245 * state[0] + 12345) % 2**31
        return state[0] % n_vocab

    def prompt(n):
        done = 0
        while done < n:
            k = min(n - done, 512)
            toks = [bos if done == 0 and bos is not None else rand()]
            toks += [rand() for _ in range(k - 1)]
            arr = (L.llama_token * k)(*toks)
            assert L.llama_decode(ctx, L.llama_batch_get_one(arr, k)) == 0
            done += k
        L.llama_synchronize(ctx)

    def gen(n):
        tok = (L.llama_token * 1)(bos if bos is not None else rand())
        for _ in range(n):
            assert L.llama_decode(ctx, L.llama_batch_get_one(tok, 1)) == 0
            L.llama_synchronize(ctx)
            tok[0] = rand()

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["test"] == "rss":  # the process's peak resident bytes so far (VmHWM)
            hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")]
            print(json.dumps({"ts": int(hwm[0].split()[1]) * 1024}))
            sys.stdout.flush()
            continue
        L.llama_memory_clear(L.llama_get_memory(ctx), False)
        if cmd["depth"]:
            prompt(cmd["depth"])
        L.llama_perf_context_reset(ctx)
        if cmd["test"] == "pp":
            prompt(cmd["n"])
        else:
            gen(cmd["n"])
        perf = L.llama_perf_context(ctx)
        if cmd["test"] == "pp":
            n, ms = perf.n_p_eval, perf.t_p_eval_ms
        else:
            n, ms = perf.n_eval, perf.t_eval_ms
        print(json.dumps({"ts": 1e3 * n / ms}), flush=True)


if __name__ == "__main__":
    main()
