#!/usr/bin/env bash
# The prepared run for a lent accelerator machine (the device tool; one call), from the
# repository root: `bash benchmarks/device.sh OUT_DIR`. Its x86-64 host first: the CPU kernels'
# tests under every variant it runs (AVX-512 where this machine has no such CPU), with the CPU
# benchmarks named in $BENCH (default: qkernel crossovers variants) pinned to two other cores at
# the same time; with "store" in $BENCH the executable store's tests and start-up figures
# (benchmarks/startup.py, on the GPU). The GPU's own figures and kernel tests are
# benchmarks/gpu.sh's, a run of their own.
# KTESTS=0 leaves the kernel tests out. Wheels the machine lacks travel in .whl/ (gguf); the shared
# tiny models in shared/models (linked to where tests/support/models.py looks).
set -uo pipefail
out=${1:-${OUT:-/tmp/device-out}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the package as an install maps it (pyproject: jaxinfer.shardings is shardings/)
[ -e jaxinfer/shardings ] || ln -s ../shardings jaxinfer/shardings
[ -d shared/models ] && [ ! -e ../shared ] && ln -s "$PWD/shared" ../shared
lscpu >"$out/lscpu.txt"
nvidia-smi >"$out/nvidia-smi.txt" 2>&1
start=$SECONDS
cpu() { JAX_PLATFORMS=cpu "$@"; }
# every variant built at once (the tests' workers would otherwise each build them)
cpu python3 -c "
from jaxinfer.kernels import build, cpu
print(cpu.status().describe(), cpu.runnable())" 2>&1 | tee "$out/kernels.txt"
variants=$(cpu python3 -c "
from jaxinfer.kernels import cpu
print(','.join(v for v in cpu.runnable() if v != 'scalar'))")
echo "built in $((SECONDS - start)) s; benchmarked variants: $variants" | tee -a "$out/kernels.txt"
[ "${KTESTS:-1}" = 0 ] || (cpu taskset -c 4-15 timeout 360 python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" \
  -n 6 tests/test_qkernel.py tests/test_kernel_variants.py tests/test_quant.py \
  tests/test_int8_activations.py >"$out/tests.log" 2>&1
  echo "pytest exit $? after $((SECONDS - start)) s" >>"$out/tests.log") &
bench=${BENCH:-qkernel crossovers variants}
[[ $bench == *qkernel* ]] && cpu taskset -c 0,1 timeout 200 python3 benchmarks/qkernel.py --quick \
  -n 9 --out "$out/qkernel.md" >"$out/qkernel.log" 2>&1
[[ $bench == *crossovers* ]] && cpu taskset -c 0,1 timeout 240 python3 benchmarks/crossovers.py \
  -n 5 --variants "$variants" --out "$out/crossovers.md" >"$out/crossovers.log" 2>&1
[[ $bench == *variants* ]] && cpu taskset -c 0,1 timeout 240 python3 benchmarks/variants.py -r 3 \
  --variants "$variants,off" --out "$out/variants.md" >"$out/variants.log" 2>&1
wait
echo "CPU part done after $((SECONDS - start)) s" | tee -a "$out/kernels.txt"
# the executable store on this machine's jax: its tests on the host CPU, then the start-up
# figures on the GPU (the default backend)
if [[ $bench == *store* ]]; then
  cpu timeout 240 python3 -m pytest -q -p no:cacheprovider -m "slow or not slow" -n 8 \
    tests/test_store.py tests/test_startup.py >"$out/store_tests.log" 2>&1
  echo "store tests exit $? after $((SECONDS - start)) s" >>"$out/store_tests.log"
  timeout 300 python3 benchmarks/startup.py -r 3 --out "$out/startup_gpu.md" \
    >"$out/startup_gpu.log" 2>&1
fi
echo "all done after $((SECONDS - start)) s" | tee -a "$out/kernels.txt"
