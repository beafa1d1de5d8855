"""Startup: `jaxinfer --help` parses its flags without importing jax (or any other heavy
dependency), and the lazy package facade still gives every public name."""

import json
import subprocess
import sys

import pytest

HEAVY = ("jax", "jaxlib", "flax", "tokenizers", "starlette", "uvicorn", "jaxinfer.engine")

HELP = """
import json, sys
import jaxinfer.cli
try:
    jaxinfer.cli.main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted(m for m in HEAVY if m in sys.modules)))
"""


@pytest.mark.parametrize("command", [None, "generate", "serve", "bench", "info"])
def test_help_does_not_import_jax(command):
    argv = [command, "--help"] if command else ["--help"]
    code = f"HEAVY = {HEAVY!r}\n{HELP}"
    out = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, check=True
    )
    assert "usage: jaxinfer" in out.stdout
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_every_public_name_resolves():
    import jaxinfer

    assert set(jaxinfer.__all__) == set(jaxinfer._SOURCES)
    for name in jaxinfer.__all__:
        assert getattr(jaxinfer, name) is not None, name
        assert name in dir(jaxinfer)
    from jaxinfer import Engine, load  # noqa: F401  (the `from` form still works)

    with pytest.raises(AttributeError):
        jaxinfer.no_such_name  # noqa: B018
