"""Peak RSS growth (ru_maxrss) of one `jaxinfer.load` of a checkpoint, jax already initialized
(run with fake CPU devices for the layout: harness.worker_env(devices=...)).

Usage: load_rss.py CHECKPOINT LAYOUT DEVICES. Prints the growth in bytes.
"""

import resource
import sys

import jax

import jaxinfer


def main():
    jax.numpy.zeros(1).block_until_ready()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    jaxinfer.load(sys.argv[1], layout=sys.argv[2], devices=int(sys.argv[3]), compile_cache_dir=None)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((peak - base) * 1024)


if __name__ == "__main__":
    main()
