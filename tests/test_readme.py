"""The README's Python examples run as written: each ```python block is executed in a folder
where the file names it uses point at the shared tiny models (stories260K for "model.gguf",
"big.gguf" and "small.gguf", its Q8_0 file for "model-Q4_K_M.gguf", the tiny Qwen3.5 for
"Qwen3.5-dir"). Blocks that talk to a running server are left to test_server.py."""

import contextlib
import io
import os
import re
from pathlib import Path

import pytest
from support.models import model_path

README = Path(__file__).resolve().parents[1] / "README.md"
NAMES = {
    "stories260K.gguf": "stories260K-gguf/stories260K.gguf",
    "model.gguf": "stories260K-gguf/stories260K.gguf",
    "big.gguf": "stories260K-gguf/stories260K.gguf",
    "small.gguf": "stories260K-gguf/stories260K.gguf",
    "model-Q4_K_M.gguf": "stories260K-gguf-quant-derived/stories260K-Q8_0.gguf",
    "hf-folder": "stories260K-hf-derived",
    "Qwen3.5-dir": "tiny-random/qwen3_5_l3f1_dense_mtp",
}


def blocks() -> list[tuple[int, str]]:
    """(line, code) of every ```python block."""
    text = README.read_text()
    return [
        (text[: m.start()].count("\n") + 1, m.group(1))
        for m in re.finditer(r"```python\n(.*?)```", text, re.S)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("line, code", blocks(), ids=[f"line{n}" for n, _ in blocks()])
def test_readme_python_block_runs(line, code, tmp_path):
    if "OpenAI(" in code:
        pytest.skip("talks to a running server (test_server.py serves the same client)")
    for name, rel in NAMES.items():
        (tmp_path / name).symlink_to(model_path(rel))
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            exec(compile("import jaxinfer\n" + code, f"README.md:{line}", "exec"), {})
    finally:
        os.chdir(here)
