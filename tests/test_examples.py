"""Every example runs with no arguments (built-in model) and, where it takes one, on a real
checkpoint."""

import subprocess
import sys
from pathlib import Path

import pytest
from support.models import model_path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(script: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs_with_no_arguments(script):
    assert run(script).strip()


def test_quickstart_on_real_checkpoint():
    out = run("quickstart.py", str(model_path("stories260K-gguf/stories260K.gguf")), "Once upon")
    assert "Once upon a time, there was a little girl" in out


def test_recompile_hook_example_reports_both_kinds():
    out = run("recompile_hook.py")
    assert "[changed shape] prefill: chunk.tokens: i32[1,16] -> i32[1,64]" in out
    assert "[SAME SHAPE] prefill: cache cleared" in out
    assert "recompiles = 2 / 1 (same shape) / (changed shape)" in out
