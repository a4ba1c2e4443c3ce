#!/usr/bin/env bash
# The prepared GPU check: the plan, its calls and their time budgets are in docs/benchmarks/gpu.md.
#
#   bash benchmarks/gpu.sh [--dry] [--budget-s SECONDS] [STEP ...]   (default: --budget-s 380 quickstart speed)
#   bash benchmarks/gpu.sh preflight                                 (here, before a device call)
#
# Every timeout inside (the wheels' install, the environment, each step) is its cap or what is left of
# --budget-s, whichever is smaller, so together they never pass the budget: give the device call a
# timeout_s 10 s above it. A step that fails or times out is reported and the next one runs; the exit
# status is 1 when any step failed. Steps:
#   quickstart    `maximus-train --config examples/quickstart.yaml` on CUDA (python3 -m maximus.train,
#                 device=cuda): its rc, log and run.json;
#   speed         speed.py --device cuda --shape 8b --quick: a Llama-3-8B-shaped QLoRA r16 step, seq 2048,
#                 Maximus vs Transformers + PEFT + bitsandbytes, each side in its own process: tokens/s, peak
#                 GPU memory, MFU, the planner's predicted peak beside ours;
#   giant         benchmarks/giant.py: a 70B-shaped QLoRA step under a 15 GiB cap;
#   long_context  long_context.py --device cuda --shape 8b: 16,384 tokens tiled, the planner's longest
#                 context for a 16 GB card (sized with this machine's host memory), the peer, untiled;
#   kernels       gpu_kernels.py --quick: each Triton kernel vs eager (not in the plan).
# Results go to $OUT (the device tool brings it back; at most 8 files) or ./gpu-results (ignored by git):
# env.txt, steps.txt (each step's rc and seconds), then each step's files as it finishes.
#
# --dry: the CPU rehearsal (tests/benchmarks/test_gpu_dry.py runs it): every step runs its real scripts
# with no GPU visible (CUDA_VISIBLE_DEVICES= MAXIMUS_GPU_DRY=1) until each process's first CUDA use, and
# passes when every process got there (benchmarks/_child.py). The carried wheels are not installed.
#
# preflight: checks, here, that .whl/ holds the wheels gpu_wheels.sh fetches and that what a device
# call carries (tracked and untracked-not-ignored files, shared/, .whl/) is under the 64 MiB limit.
set -u -o pipefail
cd "$(dirname "$0")/.."

preflight() {
    local limit=$((64 * 1024 * 1024)) tree=0 whl=0 missing=()
    for name in bitsandbytes transformers peft pydantic pydantic_core annotated_types typing_inspection \
                typing_extensions rensa ftfy wcwidth; do
        compgen -G ".whl/${name}-*.whl" > /dev/null || missing+=("$name")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "gpu.sh preflight: .whl/ lacks ${missing[*]}: run bash benchmarks/gpu_wheels.sh" >&2
        return 1
    fi
    tree=$( { git ls-files -z --cached --others --exclude-standard; [ -d shared ] && find shared -type f -print0; } \
        | xargs -0 stat -c %s 2> /dev/null | awk '{s += $1} END {print s + 0}')
    whl=$(du -sb .whl | cut -f1)
    echo "gpu.sh preflight: working tree $((tree / 1024)) KiB + .whl $((whl / 1024)) KiB" \
         "= $(((tree + whl) / 1024)) KiB of the $((limit / 1024)) KiB a device call carries"
    if [ $((tree + whl)) -gt "$limit" ]; then
        echo "gpu.sh preflight: over the limit; the largest files that would travel:" >&2
        git ls-files -z --cached --others --exclude-standard | xargs -0 du -b 2> /dev/null | sort -rn | head -5 >&2
        return 1
    fi
}

if [ "${1:-}" = preflight ]; then
    preflight
    exit $?
fi

dry=0
budget=380
while [ $# -gt 0 ]; do
    case "$1" in
        --dry) dry=1; shift ;;
        --budget-s) budget="$2"; shift 2 ;;
        *) break ;;
    esac
done
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(quickstart speed)
for step in "${steps[@]}"; do
    case "$step" in
        quickstart|speed|giant|long_context|kernels) ;;
        *) echo "gpu.sh: unknown step '$step' (quickstart, speed, giant, long_context, kernels, or preflight)" >&2
           exit 2 ;;
    esac
done
started=$SECONDS
# step_timeout CAP: the cap, or what is left of the budget (5 s kept for the end of this script), at least 1.
# A dry run checks wiring, not time: on a loaded CPU a step's cap would fail it for being slow.
step_timeout() {
    local left=$((budget - (SECONDS - started) - 5))
    [ "$dry" = 1 ] || left=$((left < $1 ? left : $1))
    echo $((left < 1 ? 1 : left))
}
out="${OUT:-gpu-results}"
mkdir -p "$out"
# The device reaches no network: nothing may wait on the hub.
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 MAXIMUS_CACHE="${MAXIMUS_CACHE:-/tmp/maximus-cache}"
if [ $dry = 1 ]; then
    export MAXIMUS_GPU_DRY=1 CUDA_VISIBLE_DEVICES=
    echo "gpu.sh --dry: no GPU visible, each process stops at its first CUDA use; carried wheels not installed"
elif compgen -G ".whl/*.whl" > /dev/null; then
    timeout "$(step_timeout 60)" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || { echo "gpu.sh: installing the carried wheels failed" >&2; exit 1; }
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
if [ $dry = 1 ]; then
    echo "env: not read in the dry run (its imports are the steps' own)" > "$out/env.txt"
else {
    timeout "$(step_timeout 20)" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
    timeout "$(step_timeout 40)" python3 -c "import sys, psutil, torch, transformers, peft, bitsandbytes, maximus
print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__,
      'peft', peft.__version__, 'bitsandbytes', bitsandbytes.__version__)
vm = psutil.virtual_memory()
print(f'host memory: {vm.total / 2**30:.1f} GiB total, {vm.available / 2**30:.1f} GiB available; {psutil.cpu_count()} CPUs')" 2>&1
} | tee "$out/env.txt"
fi

status=0
: > "$out/steps.txt"
# run_step NAME CAP LOG CMD...: CMD under its timeout, its output in LOG; rc and seconds to steps.txt.
run_step() {
    local name=$1 cap=$2 log=$3 limit rc t0=$SECONDS
    shift 3
    limit=$(step_timeout "$cap")
    if [ "$limit" -lt 15 ]; then
        echo "== $name: skipped, ${limit} s of the ${budget} s budget left" | tee -a "$out/steps.txt"
        status=1
        return
    fi
    echo "== $name: timeout ${limit} s"
    STEP_TIMEOUT=$limit timeout "$limit" "$@" 2>&1 | tee "$log"
    rc=$?
    if [ $dry = 1 ]; then  # passed when every process reached its first CUDA use, and nothing else broke
        if [ "$name" = giant ]; then  # giant.py --dry: its own stop, exit 0
            [ $rc = 0 ] || rc=1
        elif [ "$name" = quickstart ]; then  # maximus-train exits 2 with this line where no GPU is visible
            if grep -q "^error: device: cuda was requested but no CUDA GPU is available" "$log"; then
                rc=0
                echo "$name: dry run stopped at the first CUDA use (maximus-train's device check)"
            else
                rc=1
            fi
        elif [ $rc = 0 ] && ! grep -q -e "DRY-STOP" -e "dry run stopped at the first CUDA use" "$log"; then
            rc=1
            echo "$name: the dry run reached no CUDA use"
        fi
    fi
    echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$out/steps.txt"
    [ $rc = 0 ] || status=1
}

for step in "${steps[@]}"; do
    case "$step" in
        quickstart)
            run_dir="/tmp/gpu-quickstart-$$"
            run_step quickstart 80 "$out/quickstart.log" \
                python3 -m maximus.train --config examples/quickstart.yaml device=cuda "output_dir=$run_dir"
            [ -f "$run_dir/run.json" ] && cp "$run_dir/run.json" "$out/quickstart_run.json"
            ;;
        speed)
            run_step speed 280 "$out/speed_8b.md" bash -c 'exec python3 benchmarks/speed.py --device cuda --shape 8b \
                --quick --dtypes bf16 --time-budget-s $((STEP_TIMEOUT - 10)) --json "$0"' "$out/speed_8b.json"
            ;;
        giant)
            if [ ! -f benchmarks/giant.py ]; then
                echo "== giant: benchmarks/giant.py is not in this checkout" | tee -a "$out/steps.txt"
                status=1
                continue
            fi
            dry_flag=()
            [ $dry = 1 ] && dry_flag=(--dry)
            mkdir -p "$out/giant"
            run_step giant 120 "$out/giant.log" python3 benchmarks/giant.py --out "$out/giant" "${dry_flag[@]}"
            ;;
        long_context)
            run_step long_context 600 "$out/long_context_8b.md" bash -c 'exec python3 benchmarks/long_context.py \
                --device cuda --shape 8b --lengths 16384 --card 16GB --setups tiled card peer untiled \
                --time-budget-s $((STEP_TIMEOUT - 10)) --json "$0"' "$out/long_context_8b.json"
            ;;
        kernels)
            run_step kernels 150 "$out/gpu_kernels.md" python3 benchmarks/gpu_kernels.py --quick
            ;;
    esac
done
files=$(find "$out" -type f | wc -l)
[ "$files" -le 8 ] || echo "gpu.sh: $files files under $out; the device tool brings back 8" >&2
echo "gpu.sh: done in $((SECONDS - started)) s of the ${budget} s budget, status $status"
exit $status
