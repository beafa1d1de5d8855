"""The executable store of an engine over several processes (`jax.distributed`, gloo on CPU):
each process saves its own part of programs whose mesh spans every process's devices, and the
next start of the group loads them all and compiles nothing.

Two processes of 2 CPU devices each on 127.0.0.1, layout "tensor" (one mesh axis over all 4
devices), one store folder under tmp_path shared by both.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

PROCESSES = 2
TIMEOUT = 300  # seconds a start may take; a hung collective fails the test instead

# One process of the group: argv = coordinator, process id, store folder. It prints one line:
# what warmup compiled, the perf counters and the greedy tokens.
WORKER = textwrap.dedent(
    """
    import json, os, sys
    os.environ.pop("XLA_FLAGS", None)  # devices come from jax_num_cpu_devices
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    coordinator, pid, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jax.distributed.initialize(coordinator, num_processes=2, process_id=pid,
                               initialization_timeout=120)
    import jaxinfer
    engine = jaxinfer.load(None, max_seq_len=128, layout="tensor", compile_cache_dir=cache,
                           prefill_buckets=(16,), batch_buckets=(1,))
    warm = engine.warmup(progress=False)
    ids = engine.generate([1], max_new_tokens=24, temperature=0, ignore_eos=True).token_ids
    s = engine.perf_stats()
    print(json.dumps(dict(compiled=sum(n for n, _ in warm.values()), loaded=s.loaded,
                          programs=s.programs, mesh=dict(engine.mesh.shape), ids=ids)),
          flush=True)
    jax.distributed.shutdown()
    """
)


def start(cache_dir) -> list[dict]:
    """Start the group once; each process's line, by process id."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    command = [sys.executable, "-c", WORKER, f"127.0.0.1:{port}"]
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    procs = [
        subprocess.Popen([*command, str(i), str(cache_dir)], **pipes) for i in range(PROCESSES)
    ]
    lines = []
    try:
        for i, proc in enumerate(procs):
            out, err = proc.communicate(timeout=TIMEOUT)
            assert proc.returncode == 0, f"process {i}: {err[-2000:]}"
            lines.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:  # one that failed leaves the other waiting on it
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return lines


@pytest.mark.slow
def test_a_group_of_processes_loads_every_program_on_its_second_start(tmp_path):
    first = start(tmp_path)
    assert [p["mesh"] for p in first] == [{"tp": 4}] * PROCESSES  # the mesh spans both
    assert all(p["compiled"] > 0 and p["loaded"] == 0 for p in first), first
    assert first[0]["ids"] == first[1]["ids"]
    # one folder, each process's own files (its keys name it): twice the executables
    stored = list((tmp_path / "executables").glob("*.jxe"))
    assert len(stored) == PROCESSES * first[0]["programs"]
    second = start(tmp_path)
    for before, after in zip(first, second, strict=True):
        assert after["compiled"] == 0 and after["programs"] == 0, after
        assert after["loaded"] == before["programs"]
        assert after["ids"] == before["ids"]
