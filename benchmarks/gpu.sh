#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (one call of the device tool, under its 600 s),
# from the repository root: `bash benchmarks/gpu.sh OUT_DIR`. Steps, each under a `timeout`:
#   1. the environment: nvidia-smi, lscpu, Python, jax and its devices, which packages import
#      (OUT_DIR/env.txt);
#   2. the kernel tests compiled for the GPU (not interpreted), JAXINFER_KERNELS=auto at
#      JAX_DEFAULT_MATMUL_PRECISION=highest: tests/test_pallas_*.py with -x, and beside them
#      tests/test_kvcache.py tests/test_moe.py with --maxfail=20 (their layout tests ask for 2-4
#      devices, which one GPU is not, and -x there would stop the Pallas files too); JAX_PLATFORMS
#      =cuda,cpu (conftest.py defaults to cpu) and no preallocation (4 xdist workers share the
#      GPU); TEST_TIMEOUT s (150) for both together; their output and exit codes in tests.log;
#   3. benchmarks/gpu.py: kernels on (auto) vs off (xla) in one process, the 8B shape's figures
#      first, written to OUT_DIR/gpu.md after each one (gpu.py's docstring), under
#      `timeout` min(420 s, what BUDGET leaves), its output in bench.log.
# OUT_DIR gets 4 files: env.txt, tests.log, bench.log, gpu.md. BUDGET (570 s) bounds the whole
# script; ROUNDS (3) is gpu.py's -r; SECTIONS (dense,block,moe,reuse,small) its --sections;
# TESTS=0 leaves step 2 out (a second call for the sections the first had no time for).
# SMOKE=1 checks the flow on a CPU: gpu.py --smoke, the tests on JAX_PLATFORMS=cpu (only
# TESTS_SMOKE), nvidia-smi's absence noted, not fatal.
#
# Before the call, here, in the repository root:
# - the wheels the machine lacks (its image has flax, jax 0.11.2, numpy, tokenizers,
#   safetensors, jinja2, msgpack, rich, pyyaml, requests, tqdm, pytest, pytest-xdist,
#   hypothesis): llguidance (imported when an engine generates) and gguf (the GGUF fixtures);
#   Python 3.12, manylinux x86-64, no dependencies (gguf's are all there; llguidance has none;
#   llguidance 1.9.1's one Linux wheel is manylinux_2_31, which pip finds only when named):
#     echo /.whl/ >> .git/info/exclude   # already there in this checkout
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       llguidance==1.9.1 gguf==0.19.0
#   (3.2 MB: llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl, gguf-0.19.0-py3-none-any.whl.
#   jsonschema, starlette, uvicorn and prometheus-client are not needed by these steps.)
# - the shared tiny models inside the checkout (shared/ travels, ../shared does not; /shared/ is
#   in .git/info/exclude): mkdir -p shared && cp -r ../shared/models shared/
# Then: run(command="bash benchmarks/gpu.sh $OUT", carry=[".whl"], timeout_s=600).
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-out}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$SECONDS
smoke=${SMOKE:-0}
budget=${BUDGET:-570}
say() { echo "[gpu.sh $((SECONDS - start)) s] $*"; }

if compgen -G ".whl/*.whl" >/dev/null; then
  timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the package as an install maps it (pyproject: jaxinfer.shardings is shardings/)
python3 -c "import jaxinfer.shardings" 2>/dev/null || ln -s ../shardings jaxinfer/shardings
# the shared models where tests/support/models.py looks (../shared/models)
[ -d shared/models ] && [ ! -e ../shared ] && ln -s "$PWD/shared" ../shared

say "1. environment"
{
  echo "== nvidia-smi"
  timeout 30 nvidia-smi || echo "(nvidia-smi: exit $?)"
  echo "== lscpu"
  lscpu | grep -E '^(Model name|CPU\(s\)|Flags)'
  echo "== python, jax"
  timeout 90 python3 -c '
import importlib.util, sys
import jax, jaxlib
print("python", sys.version.split()[0], "| jax", jax.__version__, "| jaxlib", jaxlib.__version__)
print("devices", jax.devices(), "| default backend", jax.default_backend())
d = jax.devices()[0]
print("device kind", d.device_kind, "|", getattr(d.client, "platform_version", "?").strip())
mods = ("flax", "numpy", "gguf", "llguidance", "jsonschema", "tokenizers", "safetensors",
        "jinja2", "msgpack", "rich", "hypothesis", "xdist", "jaxinfer.shardings")
print("imports", {m: importlib.util.find_spec(m) is not None for m in mods})
' || echo "(python: exit $?)"
  echo "== pip"
  python3 -m pip list 2>/dev/null | grep -i -E '^(jax|jaxlib|jax-cuda[0-9]*-(plugin|pjrt)|flax|numpy|ml.dtypes|gguf|llguidance|pytest|pytest-xdist|hypothesis) '
} >"$out/env.txt" 2>&1
grep -v '^Flags' "$out/env.txt" | tail -n 40

if [ "${TESTS:-1}" = 0 ]; then
  echo "== step 2 left out (TESTS=0)" >"$out/tests.log"
else
  say "2. kernel tests on the device (timeout ${TEST_TIMEOUT:-150} s)"
  platforms=cuda,cpu
  tests_b=(tests/test_kvcache.py tests/test_moe.py)
  if [ "$smoke" = 1 ]; then
    platforms=cpu
    read -r -a tests_b <<<"${TESTS_SMOKE:-tests/test_kvcache.py -k paged_attention_over}"
  fi
  shopt -s nullglob
  pallas=(tests/test_pallas_*.py)
  shopt -u nullglob
  pytest_on_device() {  # LOG ARGS...: one pytest session, its output and exit code into LOG
    local log=$1
    shift
    env JAX_PLATFORMS=$platforms XLA_PYTHON_CLIENT_PREALLOCATE=false JAXINFER_KERNELS=auto \
      JAX_DEFAULT_MATMUL_PRECISION=highest timeout -k 10 "${TEST_TIMEOUT:-150}" \
      python3 -m pytest -q -p no:cacheprovider -rfE "$@" >"$log" 2>&1
    echo "== pytest $* : exit $? after $((SECONDS - start)) s (124 would mean timed out)" >>"$log"
  }
  tmp=$(mktemp -d)
  if [ ${#pallas[@]} -gt 0 ]; then
    pytest_on_device "$tmp/a.log" "${pallas[@]}" -x &
  else
    echo "== no tests/test_pallas_*.py in this tree" >"$tmp/a.log"
  fi
  pytest_on_device "$tmp/b.log" "${tests_b[@]}" --maxfail=20 &
  wait
  cat "$tmp/a.log" "$tmp/b.log" >"$out/tests.log"
  rm -rf "$tmp"
  grep -E '^(== |FAILED|ERROR|[0-9]+ (passed|failed)|.* in [0-9.]+s)' "$out/tests.log" | tail -n 40
fi

bench_t=$((budget - (SECONDS - start) - 10))
[ "$bench_t" -gt 420 ] && bench_t=420
if [ "$bench_t" -lt 30 ]; then
  say "3. benchmarks skipped: ${bench_t} s left" | tee "$out/bench.log"
else
  say "3. benchmarks/gpu.py (timeout ${bench_t} s)"
  extra=(--sections "${SECTIONS:-dense,block,moe,reuse,small}")
  if [ "$smoke" = 1 ]; then
    extra+=(--smoke)
    export JAX_PLATFORMS=cpu
  fi
  env XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 JAXINFER_COMPILE_CACHE_DIR="$(mktemp -d)" \
    timeout -k 10 "$bench_t" python3 benchmarks/gpu.py "$out" -r "${ROUNDS:-3}" \
    --budget $((bench_t - 15)) "${extra[@]}" 2>&1 | tee "$out/bench.log"
  echo "== gpu.py exit ${PIPESTATUS[0]} after $((SECONDS - start)) s (124 would mean timed out)" |
    tee -a "$out/bench.log"
fi

say "done; files in $out:"
ls -l "$out"
if [ -f "$out/gpu.md" ]; then cat "$out/gpu.md"; fi
