"""Every example runs with no arguments (the built-in stories260K model), once each, in a
fresh interpreter (slow tier)."""

import subprocess
import sys
from pathlib import Path

import pytest
from support.models import GOLDEN

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
pytestmark = pytest.mark.slow


def run(script: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


CHECKS = {
    "quickstart.py": lambda out: "Once upon a time, there was a little girl" in out,
    "recompile_hook.py": lambda out: (
        "[changed shape] prefill: chunk.tokens: i32[1,16] -> i32[1,64]" in out
        and "[SAME SHAPE] prefill: cache cleared" in out
        and "recompiles = 3 / 1 (same shape) / (changed shape)" in out
    ),
    # two local processes on jax.distributed, layer split over their 4 devices; each prints
    # the single-device greedy tokens
    "multihost.py": lambda out: (
        [
            line.startswith(f"process {i}: mesh {{'pp': 4}} tokens ")
            and line.endswith(str(GOLDEN[:24]))
            for i, line in enumerate(out.strip().splitlines())
        ]
        == [True, True]
    ),
}


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs_with_no_arguments(script):
    out = run(script)
    assert out.strip()
    assert CHECKS.get(script, lambda _: True)(out), out[-2000:]
