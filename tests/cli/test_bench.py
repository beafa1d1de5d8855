"""`jaxinfer bench` (llama-bench style) and profiler sessions."""

import json
import re

import pytest
from support.models import model_path

import jaxinfer
from jaxinfer.cli import main
from jaxinfer.cli.bench import run_bench
from jaxinfer.runtime.profiler import op_scopes, read_events, trace_files

STORIES = "stories260K-gguf/stories260K.gguf"


def bench(capsys, *extra):
    argv = ["bench", "-m", str(model_path(STORIES)), "-p", "32", "-n", "16", "-r", "2", *extra]
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.slow
def test_bench_markdown_table(capsys):
    """The table, with llama-bench's depth (-d): the tests again after 128 tokens in the
    context (pp's depth from the prefix cache: the bench refuses a run that computed it)."""
    out = bench(capsys, "--mem-bw", "10", "-d", "0,128")
    lines = out.strip().splitlines()
    assert lines[0].startswith("cpu kernels: ") and not lines[1]  # the variant in use
    assert lines[2] == "| model | size | params | backend | devices | layout | test | t/s | MBU |"
    rows = [line for line in lines[4:] if line.startswith("|")]
    assert [r.split(" | ")[6] for r in rows] == ["pp32", "tg16", "pp32 @ d128", "tg16 @ d128"]
    for row in rows:
        assert re.search(r"\| [\d.]+ ± [\d.]+ \|", row)
    assert re.search(r"\| [\d.]+% \|$", rows[1])  # decode rows carry MBU
    assert re.search(r"\| [\d.]+% \|$", rows[3])


@pytest.mark.slow
def test_bench_json_with_graph_reuse_on_and_off(capsys):
    rows = json.loads(bench(capsys, "--graph-reuse", "on,off", "-o", "json"))
    assert [(r["test"], r["graph_reuse"]) for r in rows] == [
        ("pp32", True), ("tg16", True), ("pp32", False), ("tg16", False),
    ]  # fmt: skip
    for r in rows:
        assert r["avg_ts"] > 0 and r["stddev_ts"] >= 0 and r["layout"] == "single"
        assert {"compile_seconds", "recompiles_same", "recompiles_diff", "params", "size"} <= set(r)
    # reuse off rebuilds every call: same-shape recompiles in the timed runs; on: none
    assert rows[1]["recompiles_same"] == 0 and rows[3]["recompiles_same"] > 0


def test_prompt_runs_never_hit_the_prefix_cache():
    """pp repeats one prompt: each run must compute all of it (a prefix cache hit would
    time pages that were never computed), as llama-bench's pp does."""
    engines = []

    def make(layout, devices, slots, reuse, need):
        engines.append(jaxinfer.load(model_path(STORIES), max_seq_len=need, page_size=16))
        return engines[-1]

    run_bench(make, prompts=[64], gens=[], repeats=2, layouts=["single"], devices=[None],
              slots=[1], graph_reuse=[True], mem_bw=1e9)  # fmt: skip
    stats = engines[0].kv_stats()
    assert stats["prefix_queries"] > 0 and stats["prefix_hits"] == 0, stats


@pytest.mark.slow
def test_bench_layouts_csv(capsys):
    out = bench(capsys, "--layout", "single,layer", "--devices", "2", "-n", "0", "-o", "csv")
    lines = out.strip().splitlines()
    assert lines[0].startswith("model,size,params,backend,devices,layout,test")
    assert [line.split(",")[5] for line in lines[1:]] == ["single", "layer"]


def test_profile_run_writes_a_trace_with_steps_and_scopes(tmp_path, capsys):
    trace = tmp_path / "trace"
    argv = ["generate", "-m", str(model_path(STORIES)), "-p", "Once upon a time", "-n", "40",
            "--temp", "0", "--profile", str(trace)]  # fmt: skip
    assert main(argv) == 0
    files = trace_files(trace)
    assert files["xplane"].stat().st_size > 0 and files["trace"].name.endswith(".trace.json.gz")
    events = read_events(trace)
    steps = [e for e in events if e.get("name") == "decode" and "step_num" in e.get("args", {})]
    assert len(steps) >= 2  # 39 tokens after prefill, 16 per decode call
    assert any(e.get("name") == "prefill" for e in events)
    # the decode program compiled, or loaded from an earlier test's executable store
    assert any(re.match(r"(compile decode:|load decode from)", str(e.get("name"))) for e in events)
    # Ops in the trace point, through the compiled HLO's metadata, to the layer scopes.
    import jaxinfer

    engine = jaxinfer.load(model_path(STORIES))  # the CLI's shapes: its programs are cached
    engine.generate("Once upon a time", max_new_tokens=40, temperature=0)
    (decode,) = engine.compile_cache.executables("decode")
    scopes = op_scopes(decode.as_text())
    traced = {e["args"]["hlo_op"] for e in events if "hlo_op" in e.get("args", {})}
    named = {scopes[op] for op in traced if op in scopes}
    # stories260K's 5 layers are one run of depth-shared layers: one traced body, one scope
    # (run_0/segment_0/jit(_block)/attn/...); each layer's own with shared_layers=False
    assert any(re.search(r"run_0/segment_0/(jit\(_block\)/)?attn", s) for s in named)
    assert any(re.search(r"run_0/segment_0/(jit\(_block\)/)?mlp", s) for s in named)


def test_profile_dir_api(tmp_path, stories_hf):
    result = stories_hf.generate([1], max_new_tokens=20, temperature=0, profile_dir=tmp_path)
    assert len(result.token_ids) == 20
    assert any(e.get("name") == "decode" for e in read_events(tmp_path))
