"""Several processes, one global mesh: `jax.distributed` on this machine (127.0.0.1).

With no --process-id this script is the launcher: it starts N worker processes of itself
(each with its own CPU devices), waits, and prints what each one generated. Each worker joins
the distributed runtime, loads the model with a layout over all processes' devices (each
process loads only its own shards), and generates greedily. On real hosts, run one worker per
host with the same --coordinator and that host's --process-id.

    python examples/multihost.py [--model PATH] [--layout layer] [--processes 2]
"""

import argparse
import os
import socket
import subprocess
import sys


def worker(args) -> None:
    os.environ.pop("XLA_FLAGS", None)  # devices come from jax_num_cpu_devices below
    import jax

    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.distributed.initialize(
        args.coordinator, num_processes=args.processes, process_id=args.process_id,
        initialization_timeout=120,
    )  # fmt: skip
    import jaxinfer

    engine = jaxinfer.load(args.model, max_seq_len=128, layout=args.layout)
    result = engine.generate([1], max_new_tokens=24, temperature=0, ignore_eos=True)
    mesh = dict(engine.mesh.shape)
    print(f"process {args.process_id}: mesh {mesh} tokens {result.token_ids}", flush=True)
    jax.distributed.shutdown()


def launch(args) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, __file__, "--coordinator", f"127.0.0.1:{port}",
            "--processes", str(args.processes), "--layout", args.layout,
            "--local-devices", str(args.local_devices)]  # fmt: skip
    if args.model:
        base += ["--model", args.model]
    procs = [
        subprocess.Popen(base + ["--process-id", str(i)], stdout=subprocess.PIPE, text=True)
        for i in range(args.processes)
    ]
    failed = False
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        print(out.strip().splitlines()[-1] if out.strip() else "(no output)")
        failed |= proc.returncode != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: built-in)")
    ap.add_argument("--layout", default="layer")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--local-devices", type=int, default=2, help="CPU devices per process")
    ap.add_argument("--process-id", type=int, default=None)
    ap.add_argument("--coordinator", default=None)
    args = ap.parse_args()
    worker(args) if args.process_id is not None else launch(args)
