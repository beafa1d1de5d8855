"""The runtime: compiled programs and their cache, the executor, the scheduler's one loop,
requests, speculative decoding, perf stats and profiling."""
