"""The documentation's Python examples run as written: each ```python block of README.md and
docs/*.md is executed in a folder where the file names it uses point at the shared tiny models
(stories260K for "model.gguf", "big.gguf" and "small.gguf", its Q8_0 file for
"model-Q4_K_M.gguf", the tiny Qwen3.5 for "Qwen3.5-dir"). Blocks that talk to a running server
are left to test_server.py. docs/cli.md is the CLI parser's reference, kept current by
docs/gen_cli.py."""

import contextlib
import importlib.util
import io
import os
import re
from pathlib import Path

import pytest
from support.models import model_path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NAMES = {
    "stories260K.gguf": "stories260K-gguf/stories260K.gguf",
    "model.gguf": "stories260K-gguf/stories260K.gguf",
    "big.gguf": "stories260K-gguf/stories260K.gguf",
    "small.gguf": "stories260K-gguf/stories260K.gguf",
    "model-Q4_K_M.gguf": "stories260K-gguf-quant-derived/stories260K-Q8_0.gguf",
    "hf-folder": "stories260K-hf-derived",
    "Qwen3.5-dir": "tiny-random/qwen3_5_l3f1_dense_mtp",
}


def blocks() -> list[tuple[str, int, str]]:
    """(page, line, code) of every ```python block of the README and the docs; a block that
    repeats an earlier one word for word (the README quoting a guide) runs once."""
    out, seen = [], set()
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT).as_posix()
        for m in re.finditer(r"```python\n(.*?)```", text, re.S):
            if m.group(1).strip() not in seen:
                seen.add(m.group(1).strip())
                out.append((name, text[: m.start()].count("\n") + 1, m.group(1)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "page, line, code", blocks(), ids=[f"{page}:line{n}" for page, n, _ in blocks()]
)
def test_docs_python_block_runs(page, line, code, tmp_path):
    if "OpenAI(" in code:
        pytest.skip("talks to a running server (test_server.py serves the same client)")
    for name, rel in NAMES.items():
        (tmp_path / name).symlink_to(model_path(rel))
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            exec(compile("import jaxinfer\n" + code, f"{page}:{line}", "exec"), {})
    finally:
        os.chdir(here)


def test_cli_reference_is_current():
    """docs/cli.md's generated part equals what the parser gives now."""
    spec = importlib.util.spec_from_file_location("gen_cli", ROOT / "docs" / "gen_cli.py")
    gen_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_cli)
    current = gen_cli.CLI_MD.read_text()
    assert current == gen_cli.render(current), (
        "docs/cli.md is out of date with the jaxinfer parser: run `python docs/gen_cli.py`"
    )
