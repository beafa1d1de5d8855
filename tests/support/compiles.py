"""Compiles seen by jax.monitoring, independently of jaxinfer's own counters."""

import jax


class CompileCounter:
    """Counts XLA backend compiles seen by jax.monitoring while active."""

    def __init__(self):
        self.n = 0

    def _listener(self, name, _secs, **_kw):
        if name == "/jax/core/compile/backend_compile_duration":
            self.n += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)
