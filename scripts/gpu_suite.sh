#!/usr/bin/env bash
# The whole GPU check in one command: versions and device, the GPU tests, the normal
# test suite with real kernel lowering, then every benchmark, all written to one folder
# (with the markdown block to paste into benchmarks/RESULTS.md).
#
#   scripts/gpu_suite.sh [OUT_DIR] [STAGE...]
#
# OUT_DIR defaults to $OUT when set, else ./gpu-results. STAGEs (default: env gpu-tests
# tests bench, in order):
#   env        jax/jaxlib versions, devices, nvidia-smi              -> env.txt
#   smoke      pytest -m "gpu and smoke": a few compiled tests of every kernel, for each
#              kernel edit (about a minute)                          -> smoke.log/.xml
#   gpu-tests  pytest -m gpu                                          -> gpu-tests.log/.xml
#              (verbose: a run cut short by a time limit still names each result so far)
#   tests      pytest -m "not gpu and not interpreted", Pallas kernels compiled for real
#              (tests that force the interpreter run at CPU speed; CI covers them) -> tests.log/.xml
#   bench      python -m benchmarks all                               -> benchmarks/, bench.log
# The test stages run in GPU_TEST_WORKERS pytest-xdist processes sharing the GPU (default 8:
# compiling kernels is what takes the time, on the CPU), with JAX's persistent compilation
# cache in JAX_COMPILATION_CACHE_DIR (default ./.jax-cache, git-ignored, so it stays on a warm
# device machine between calls; carry it to a fresh one). env, gpu-tests and tests fit one
# 10-minute call on an H100 machine; bench takes its own.
# Environment: PYTHON (default python), PYTEST_ARGS (extra pytest arguments, shell-quoted: "-k 'not random'"), BENCH_ARGS
# (extra arguments of `python -m benchmarks all`, e.g. --attention-args "...").
# Never installs from the internet; at most `pip install -e . --no-deps --no-build-isolation`.
set -u
cd "$(dirname "$0")/.."
OUT_DIR="${1:-${OUT:-gpu-results}}"
shift $(( $# > 0 ? 1 : 0 ))
STAGES="${*:-env gpu-tests tests bench}"
PY="${PYTHON:-python}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/summary.txt"
STATUS=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# Run from this checkout: an editable install when possible, the source tree on the path always.
if ! "$PY" -c "import omni_jax" >/dev/null 2>&1; then
  "$PY" -m pip install -e . --no-deps --no-build-isolation >"$OUT_DIR/pip.log" 2>&1 \
    || note "note: pip install -e . failed (pip.log); using PYTHONPATH"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset OMNI_JAX_PALLAS_INTERPRET  # kernels must lower and run for real here
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several test processes share the GPU
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$PWD/.jax-cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
WORKERS="${GPU_TEST_WORKERS:-8}"

stage() {  # stage NAME COMMAND...: runs, logs, records the exit status
  local name="$1"; shift
  local start=$SECONDS
  echo "== $name: $*"
  "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  note "$name: exit $rc in $(( SECONDS - start )) s"
  # pytest exit 5 = nothing collected (e.g. no GPU tests yet): not a failure.
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then STATUS=1; fi
}

for s in $STAGES; do
  case "$s" in
    env)
      {
        date -u
        git rev-parse HEAD 2>/dev/null
        "$PY" -c 'import sys, jax, jaxlib; print("python", sys.version.split()[0]); print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print("backend", jax.default_backend()); [print(d, d.device_kind) for d in jax.devices()]'
        "$PY" -c 'import jax_cuda13_plugin as p; print("cuda plugin", p.__file__)' 2>/dev/null
        "$PY" -m pip list 2>/dev/null | grep -iE "^(jax|flax|optax|triton|tokamax|nvidia-cudnn)" 
        nvidia-smi -L 2>/dev/null; nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv 2>/dev/null
      } 2>&1 | tee "$OUT_DIR/env.txt"
      "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' \
        || note "WARNING: JAX sees no GPU; GPU tests will skip and timings are not GPU timings"
      ;;
    smoke)
      eval "set -- ${PYTEST_ARGS:-}"
      stage smoke "$PY" -m pytest -m "gpu and smoke" -n "$WORKERS" -v -rfEs --junitxml="$OUT_DIR/smoke.xml" "$@" ;;
    gpu-tests)
      eval "set -- ${PYTEST_ARGS:-}"
      stage gpu-tests "$PY" -m pytest -m gpu -n "$WORKERS" -v -rfEs --durations=15 --junitxml="$OUT_DIR/gpu-tests.xml" "$@" ;;
    tests)
      eval "set -- ${PYTEST_ARGS:-}"
      stage tests "$PY" -m pytest -m "not gpu and not interpreted" -n "$WORKERS" -v -rfEs --durations=15 --junitxml="$OUT_DIR/tests.xml" "$@" ;;
    bench)
      eval "set -- ${BENCH_ARGS:-}"
      stage bench "$PY" -m benchmarks all --out-dir "$OUT_DIR/benchmarks" "$@"
      if [ -f "$OUT_DIR/benchmarks/RESULTS-block.md" ]; then
        cp "$OUT_DIR/benchmarks/RESULTS-block.md" "$OUT_DIR/RESULTS-block.md"
        echo "== markdown for benchmarks/RESULTS.md ($OUT_DIR/RESULTS-block.md):"
        cat "$OUT_DIR/RESULTS-block.md"
      fi
      ;;
    *) note "unknown stage '$s' (expected env, smoke, gpu-tests, tests, bench)"; STATUS=2 ;;
  esac
done
echo "== summary ($SUMMARY)"; cat "$SUMMARY" 2>/dev/null
exit $STATUS
