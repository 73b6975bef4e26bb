#!/usr/bin/env bash
# One call on a machine with CUDA (a session lent a GPU runs it as is): every CUDA test of the suite (among them
# ktrun's Triton W4A16 kernel on vLLM's golden layers and a model on it), the GPU Linears at decode (the Triton
# kernel's weight bandwidth at M = 1 / 4 / 16 against the device's, torch's bf16 matmul and Marlin when installed),
# the hybrid decode step of the DeepSeek-V3-shaped bench model (GPU layers int4 on the Triton kernel, routed experts
# on the CPU kernels) against max(CPU experts alone, GPU part alone), then a decode benchmark with 0 / 10 / 50% of the
# routed experts on the GPU; prints `name: value unit` lines; under 8 minutes.
#
#   bash bench/device_check.sh            # from the repository root (or anywhere: it cds there)
#
# Works from a bare copy of the working tree: it uses $KT_PY, else .venv/bin/python when that has torch, else python3;
# puts the packages on PYTHONPATH when they are not installed (ktlayouts = layouts/, ktrun = runtime/); builds the
# kernel library with CMake when none loads (without one the CPU side falls back to the torch reference experts).
# Without CUDA it still runs: the CUDA tests are skipped (listed) and the benchmark's "GPU" is torch on the CPU.
# Time limits: setup 75 s, tests 200 s, GPU Linears 45 s, hybrid step 60 s, hot-expert decode 100 s (each part is
# cut at its limit and says so).
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
WORK=build/device_check
mkdir -p "$WORK"
export OMP_WAIT_POLICY=PASSIVE CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1

PY=${KT_PY:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" 2>/dev/null; then PY=.venv/bin/python; else PY=python3; fi
fi
echo "python: $($PY -c 'import sys; print(sys.version.split()[0])') version ($PY)"
if ! $PY -c "import torch" 2>/dev/null; then echo "torch_importable: 0 bool"; echo "device_check_ok: 0 bool"; exit 1; fi
$PY - <<'EOF'
import torch
print(f"torch_version: {torch.__version__} version")
print(f"cuda_available: {int(torch.cuda.is_available())} bool")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"cuda_device: {p.name.replace(' ', '_')} name")
    print(f"cuda_memory: {p.total_memory / 2**30:.1f} GiB")
EOF

# --- setup: packages and kernel library ---------------------------------------------------------------------------
if ! $PY -c "import ktrun, ktlayouts, ktconvert" 2>/dev/null; then
  mkdir -p "$WORK/pkgs"
  ln -sfn "$PWD/layouts" "$WORK/pkgs/ktlayouts"
  ln -sfn "$PWD/runtime" "$WORK/pkgs/ktrun"
  ln -sfn "$PWD/ktconvert" "$WORK/pkgs/ktconvert"
  export PYTHONPATH="$PWD/$WORK/pkgs:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
  echo "packages_from_source_tree: 1 bool"
fi
if ! $PY -c "from ktrun.ops.moe import load_library; load_library()" 2>/dev/null; then
  if command -v cmake >/dev/null; then
    timeout 15 cmake -S kernels -B "$WORK/kernels" -DCMAKE_BUILD_TYPE=Release -DKT_BUILD_TESTS=OFF >/dev/null \
      && timeout 60 cmake --build "$WORK/kernels" -j "$(nproc)" >/dev/null
    LIB=$(ls "$WORK"/kernels/libktkernels*.so 2>/dev/null | head -1)
    [ -n "$LIB" ] && export KT_KERNELS_LIB="$PWD/$LIB"
  fi
fi
if $PY -c "from ktrun.ops.moe import MoEKernels; m = MoEKernels(); print(f'kernel_backend: {m.backend} name'); print(f'kernel_threads: {m.n_threads} count')"; then
  :
else
  echo "kernels_loaded: 0 bool (the CPU side runs the torch reference experts)"
fi
missing=$($PY - <<'EOF'
import importlib.util
need = ["pytest", "numpy", "safetensors", "tokenizers", "click", "tqdm", "psutil", "jinja2", "transformers", "gguf"]
print(" ".join(m for m in need if importlib.util.find_spec(m) is None))
EOF
)
[ -n "$missing" ] && echo "missing_modules: $missing names"
echo "setup_seconds: $(( $(date +%s) - T0 )) s"

# --- every CUDA test (the test files that hold a test marked cuda) ----------------------------------------------
FILES=$(grep -l "mark\.cuda" tests/test_*.py | tr '\n' ' ')
echo "cuda_test_files: $(echo $FILES | wc -w) count"
T1=$(date +%s)
timeout 200 $PY -m pytest -q -rs -m cuda -p no:cacheprovider $FILES > "$WORK/cuda_tests.txt" 2>&1
rc=$?
tail -n 40 "$WORK/cuda_tests.txt" | grep -E "SKIPPED|FAILED|ERROR|passed|failed|error" | sed 's/^/# /'
summary=$(grep -E "[0-9]+ (passed|failed|skipped|error)" "$WORK/cuda_tests.txt" | tail -1)
for k in passed failed skipped error deselected; do
  n=$(echo "$summary" | grep -oE "[0-9]+ $k" | grep -oE "[0-9]+" || true)
  echo "cuda_tests_$k: ${n:-0} count"
done
[ $rc -eq 124 ] && echo "cuda_tests_timed_out: 1 bool"
echo "cuda_tests_exit_code: $rc code"
echo "cuda_tests_seconds: $(( $(date +%s) - T1 )) s"

# --- GPU Linears at decode: dense bf16, per-call dequant, Marlin (when installed), ktrun's Triton kernel ------------
T3=$(date +%s)
timeout 45 $PY bench/bench_gpu_linear.py --reps 10 2> "$WORK/gpu_linear_stderr.txt"
grc=$?
[ $grc -eq 124 ] && echo "gpu_linear_bench_timed_out: 1 bool"
[ $grc -ne 0 ] && tail -n 5 "$WORK/gpu_linear_stderr.txt" | sed 's/^/# /'
echo "gpu_linear_bench_exit_code: $grc code"
echo "gpu_linear_bench_seconds: $(( $(date +%s) - T3 )) s"

# --- the hybrid step: GPU layers int4 on the Triton kernel beside the CPU experts (CUDA only) ----------------------
hrc=0
if $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  T4=$(date +%s)
  timeout 60 $PY bench/bench_decode.py --device cuda --dense-format triton-int4 --layers 2 --experts 16 --tg 32 \
    --pp 64 --reps 2 2> "$WORK/hybrid_stderr.txt" | sed 's/^/hybrid_/'
  hrc=${PIPESTATUS[0]}
  [ $hrc -eq 124 ] && echo "hybrid_step_bench_timed_out: 1 bool"
  [ $hrc -ne 0 ] && tail -n 5 "$WORK/hybrid_stderr.txt" | sed 's/^/# /'
  echo "hybrid_step_bench_exit_code: $hrc code"
  echo "hybrid_step_bench_seconds: $(( $(date +%s) - T4 )) s"
else
  echo "# no CUDA: the hybrid step (GPU layers on the Triton kernel beside the CPU experts) not measured"
fi

# --- decode benchmark: 0 / 10 / 50% of the experts hot ------------------------------------------------------------
T2=$(date +%s)
timeout 100 $PY bench/bench_hot_experts.py --decode-only --tokens 2000 --tg 64 --reps 3 --out "$WORK/bench" \
  ${KT_DEVICE_CHECK_BENCH_ARGS:-} 2> "$WORK/bench_stderr.txt"
brc=$?
[ $brc -eq 124 ] && echo "decode_bench_timed_out: 1 bool"
[ $brc -ne 0 ] && tail -n 5 "$WORK/bench_stderr.txt" | sed 's/^/# /'
echo "decode_bench_exit_code: $brc code"
echo "decode_bench_seconds: $(( $(date +%s) - T2 )) s"
echo "device_check_seconds: $(( $(date +%s) - T0 )) s"
[ $rc -eq 0 ] && [ $grc -eq 0 ] && [ $hrc -eq 0 ] && [ $brc -eq 0 ] && echo "device_check_ok: 1 bool" || { echo "device_check_ok: 0 bool"; exit 1; }
