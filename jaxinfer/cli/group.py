"""A command over several processes: `--coordinator HOST:PORT --num-processes N --process-id I`
(or JAX_COORDINATOR_ADDRESS, or a cluster jax detects) joins `jax.distributed` before anything
touches a device. Every process loads the model with the same flags, each placing its own
shards of the one mesh over all processes' devices. Process 0 then runs the command (the HTTP
front door, the prompts) and leads; every other process warms up, follows (runs the device
calls process 0 sends, runtime/lockstep.py) until process 0 stops the group, and exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading

from ..errors import JaxinferError

log = logging.getLogger(__name__)
EXIT_AFTER = 30.0  # seconds a leader whose group ended may take to stop before it is ended


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several processes (jax.distributed; all three, or none)")
    g.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's host and a free port there, the same on every process",
    )
    g.add_argument(
        "--num-processes", type=int, default=None, metavar="N", help="processes in the group"
    )
    g.add_argument(
        "--process-id",
        type=int,
        default=None,
        metavar="I",
        help="this process's number, 0..N-1 (0 serves, the others follow it)",
    )


def join(args) -> bool:
    """Join the group the flags or the environment name; True when there are several
    processes. A plain start stays one process (nothing is initialized)."""
    from ..runtime.lockstep import initialize

    return initialize(args.coordinator, args.num_processes, args.process_id)


def leader() -> bool:
    import jax

    return jax.process_index() == 0


def follow(engine, warm: bool = True) -> None:
    """A follower's life after load: warm up as process 0 does (`warm`: a server does, generate
    compiles what it calls), report its share, run process 0's calls until it stops the
    group, report its compiles after warmup."""
    import jax

    from ..runtime.lockstep import Follower, connect, leave
    from ..serve.metrics import process_counters

    spanned(engine)
    if warm:
        engine.warmup(progress=False)
    at_ready = compiles(engine)
    share(engine)
    follower = connect(identity(engine), lambda: process_counters(engine, at_ready))
    assert isinstance(follower, Follower)
    engine.follow(follower)
    print(f"process {jax.process_index()}: compiles after warmup = "
          f"{compiles(engine) - at_ready}", file=sys.stderr, flush=True)  # fmt: skip
    leave(follower)


def follow_engines(args, make) -> None:
    """A follower of a command that makes several engines (bench): for each one process 0
    announces (Leader.engine), make the same with `make(*what it said)` and follow it."""
    from ..runtime.lockstep import Follower, connect, leave

    follower = connect(flags(args))
    assert isinstance(follower, Follower)
    made = follower.serve()
    while made is not None:
        engine = make(*made)
        spanned(engine)
        made = engine.follow(follower)
    leave(follower)


def lead_engines(args):
    """Process 0 of a command that makes several engines: the group's Leader, before any."""
    from ..runtime.lockstep import Leader, connect

    leader = connect(flags(args))
    assert isinstance(leader, Leader)
    return leader


def flags(args) -> str:
    """What must be the same on every process of a command that makes several engines: its
    flags (but --process-id)."""
    return repr(sorted((k, repr(v)) for k, v in vars(args).items() if k != "process_id"))


def lead(engine, on_lost=None):
    """Process 0, its engine warmed up (or not: the followers compile what it compiles):
    open the group's channel and lead it; `on_lost(reason)` when a process goes. The
    process is ended EXIT_AFTER seconds after a loss if it has not stopped by then (its
    engine thread may be blocked in a collective forever)."""
    from ..runtime.lockstep import Leader, connect

    spanned(engine)
    leader = connect(identity(engine))
    assert isinstance(leader, Leader)

    def lost(reason: str) -> None:
        timer = threading.Timer(EXIT_AFTER, os._exit, (3,))
        timer.daemon = True
        timer.start()
        if on_lost is not None:
            on_lost(reason)

    leader.on_lost = lost
    engine.lead(leader)
    share(engine)
    return leader


def finish(leader, compiles_after_warmup: int | None = None) -> None:
    """Process 0 done: report, stop the followers, leave the group. After a loss the process
    ends at once (a collective with the lost process would hang jax's shutdown)."""
    from ..runtime.lockstep import leave

    if compiles_after_warmup is not None:
        print(f"process 0: compiles after warmup = {compiles_after_warmup}", file=sys.stderr,
              flush=True)  # fmt: skip
    if leader is None:
        return
    if leader.lost is not None:
        sys.stderr.flush()
        os._exit(1)
    leader.close()
    leave(leader)


def share(engine) -> None:
    """One line per process: its share of the weights and of the devices."""
    import jax

    mine = engine.weight_bytes()
    whole = sum(leaf.nbytes for leaf in jax.tree.leaves(engine.params))
    devices = list(engine.mesh.devices.flat)
    local = sum(d.process_index == jax.process_index() for d in devices)
    total = len(devices)
    print(f"process {jax.process_index()} of {jax.process_count()}: {mine / 2**20:.2f} MiB of the "
          f"weights ({whole / 2**20:.2f} MiB in all) on its {local} of {total} devices",
          file=sys.stderr, flush=True)  # fmt: skip


def spanned(engine) -> None:
    """Refuse a layout whose mesh leaves a process out (e.g. `single`: the model on process 0's
    first device): that process could run none of its calls. Every process finds the same."""
    import jax

    there = {d.process_index for d in engine.mesh.devices.flat}
    if len(there) < jax.process_count():
        raise JaxinferError(
            f"the layout {engine.layout!r} puts the model on the devices of {len(there)} of the "
            f"{jax.process_count()} processes; use one that spans them all (layer, tensor, "
            "layer-tensor, expert...), or run one process"
        )


def identity(engine) -> str:
    """What must be the same on every process: the model (its config and format, not its path:
    each host has its own copy), its options (--fit-memory apart: the plan agrees on the least
    memory) and the shapes they gave."""
    options = engine.options.replace(fit_memory_mib=None)
    return repr((engine.cfg, engine.source, options, engine.kv_config, engine.shapes))


def compiles(engine) -> int:
    stats = engine.perf_stats()
    return stats.programs + stats.untracked_compiles
