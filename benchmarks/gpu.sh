#!/usr/bin/env bash
# The prepared GPU check (issue 9), about 6-8 minutes on an H200 for steps 1-2 (one call of
# the device tool), about 4 minutes for step 3 (a second call, `bash benchmarks/gpu.sh long_context`),
# and `bash benchmarks/gpu.sh grpo` for GRPO's vLLM generation (tests/train/test_grpo_vllm.py, needs vllm):
#   1. speed.py --device cuda --shape 8b: a Llama-3-8B-shaped QLoRA r16 step, seq 2048, batch 1:
#      Maximus (optimization.kernels auto = Triton) vs Transformers + PEFT + bitsandbytes in the same
#      run: tokens/s, peak GPU memory, MFU against the bf16 matmul rate measured there;
#   2. gpu_kernels.py --quick: each Triton kernel vs eager, and an 8B-shaped decoder-layer step;
#   3. long_context.py --device cuda --shape 8b (issue 17): QLoRA r=32 at 16,384 tokens, tiled /
#      untiled / Transformers + PEFT + bnb with gradient checkpointing (peak GPU memory, tokens/s,
#      prediction beside each), then the planner's longest context for a 16 GB card run under
#      target_vram: 16GB (its peak must stay under the budget). Rows land in long_context_8b.json
#      as they finish, so a timeout keeps the ones done.
#
# The device image has no bitsandbytes or pydantic: first, here, `bash benchmarks/gpu_wheels.sh`
# (writes .whl/), then call the device tool with
#   command "bash benchmarks/gpu.sh", carry [".whl"], timeout_s 590
# Results: $OUT (the device tool fetches it) or ./gpu-results: env.txt, speed_8b.md/.json, gpu_kernels.md,
# long_context_8b.md/.json.
set -u -o pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu.sh: installing the carried wheels failed" >&2; exit 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MAXIMUS_CACHE="${MAXIMUS_CACHE:-/tmp/maximus-cache}"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    python3 -c "import sys, torch, transformers, peft, bitsandbytes, triton, maximus
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__,
      'peft', peft.__version__, 'bitsandbytes', bitsandbytes.__version__, 'triton', triton.__version__)" 2>&1
} | tee "$out/env.txt"
status=0
if [ "${1:-speed}" = grpo ]; then
    # grpo.generation: vllm (a colocated vLLM engine, the adapter synced each generation): its test
    # skips where the vllm package is missing, and says so in grpo_vllm.txt.
    timeout 500 python3 -m pytest -q -rs tests/train/test_grpo_vllm.py 2>&1 | tee "$out/grpo_vllm.txt" || status=1
    exit $status
fi
if [ "${1:-speed}" = long_context ]; then
    timeout 560 python3 benchmarks/long_context.py --device cuda --shape 8b --lengths 16384 --card 16GB \
        --json "$out/long_context_8b.json" 2>&1 | tee "$out/long_context_8b.md" || status=1
    exit $status
fi
timeout 420 python3 benchmarks/speed.py --device cuda --shape 8b --quick --worker-timeout 300 \
    --json "$out/speed_8b.json" 2>&1 | tee "$out/speed_8b.md" || status=1
timeout 150 python3 benchmarks/gpu_kernels.py --quick 2>&1 | tee "$out/gpu_kernels.md" || status=1
exit $status
