#!/usr/bin/env bash
# Device check for a lent CUDA machine with torch and transformers but no package registry: the standalone checks,
# then pytest -m cuda, with roll from its source folders. Writes env.txt, check.txt and pytest.txt under $OUT (or
# ./device-out). The pure-Python dependencies travel as wheels in .whl/, downloaded beforehand where pip works:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .whl tensordict==0.15.3 hydra-core==1.3.8 omegaconf==2.3.1 \
#     megatron-core==0.16.1 'pyvers>=0.2,<0.3'
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3      # sdist only on PyPI
# With a registry, `nox -s device -- cuda` does all of this and adds vLLM.
OUT=${OUT:-device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || { echo 'no wheels in .whl/ (see above)'; exit 3; }
S=packages/roll-hw/src:packages/roll-algos/src:packages/roll-core/src:packages/roll-engines/src:packages/roll-envs/src
export PYTHONPATH=/tmp/site:$S
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep "Model name";
  python3 -c "import torch,transformers,sys;print('python',sys.version.split()[0],'torch',torch.__version__,'cuda',torch.version.cuda,'transformers',transformers.__version__)"; } 2>&1 | tee $OUT/env.txt
t0=$(date +%s)
timeout 230 python3 tests/device/check_accelerator.py --device cuda --check-timeout 150 --require megatron-core 2>&1 | tee $OUT/check.txt
echo "check_accelerator rc=${PIPESTATUS[0]} wall=$(( $(date +%s) - t0 ))s" | tee -a $OUT/check.txt
t0=$(date +%s)
FILES="packages/roll-engines/tests/test_device.py packages/roll-engines/tests/test_vllm_fp8.py packages/roll-engines/tests/test_vllm_vlm.py packages/roll-engines/tests/test_sglang.py tests/e2e/test_weight_sync_cuda.py"
ROLL_TEST_SESSION=device-cuda timeout 150 python3 -m pytest -m cuda -p no:cacheprovider --timeout=120 -rA -q $FILES 2>&1 | tee $OUT/pytest.txt
echo "pytest rc=${PIPESTATUS[0]} wall=$(( $(date +%s) - t0 ))s" | tee -a $OUT/pytest.txt
