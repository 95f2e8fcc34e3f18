#!/usr/bin/env bash
# Device checks for a lent CUDA machine that has torch and transformers but no package registry:
#   bash tests/device/lent_machine.sh [check] [pytest] [runs]      (default: all three)
# check: tests/device/check_accelerator.py (engines driven directly); pytest: `pytest -m cuda` over the files that
# mark tests for cuda; runs: tests/device/gpu_runs.py (roll-train's path: configs, trainer, checkpoints).
# Writes env.txt and one .txt per step under $OUT (or ./device-out). The dependencies travel as wheels in .whl/,
# made beforehand where pip works (roll's own wheels carry the entry points that register engines and configs):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl tensordict==0.15.3 hydra-core==1.3.8 omegaconf==2.3.1 \
#     megatron-core==0.16.1 'pyvers>=0.2,<0.3'
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3 packages/roll-*      # antlr4: sdist only on PyPI
# With a registry, `nox -s device -- cuda` builds a venv with all of this and adds vLLM.
OUT=${OUT:-device-out}; mkdir -p "$OUT"
steps=${*:-check pytest runs}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
  { echo "no wheels in .whl/ (see the comment above)"; exit 3; }
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep "Model name"
  python3 -c "import torch,transformers,sys;print('python',sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda,'transformers',transformers.__version__)"; } 2>&1 | tee "$OUT/env.txt"
rc=0
step() {  # name, timeout, command...
  local name=$1 limit=$2 t0; shift 2; t0=$(date +%s)
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  local s=${PIPESTATUS[0]}; [ "$s" = 0 ] || rc=1
  echo "$name rc=$s wall=$(( $(date +%s) - t0 ))s" | tee -a "$OUT/$name.txt"
}
for s in $steps; do
  case $s in
    check) step check 230 python3 tests/device/check_accelerator.py --device cuda --check-timeout 150 --require megatron-core ;;
    pytest) step pytest 150 env ROLL_TEST_SESSION=device-cuda python3 -m pytest -m cuda -p no:cacheprovider --timeout=120 -rA -q \
      packages/roll-engines/tests/test_device.py packages/roll-engines/tests/test_vllm_fp8.py \
      packages/roll-engines/tests/test_vllm_vlm.py packages/roll-engines/tests/test_vllm_routing.py packages/roll-engines/tests/test_sglang.py \
      tests/e2e/test_weight_sync_cuda.py ;;
    runs) step runs 300 python3 tests/device/gpu_runs.py --hw cuda --json "$OUT/runs.json" ;;
    *) echo "unknown step $s (check, pytest, runs)"; exit 2 ;;
  esac
done
exit $rc
