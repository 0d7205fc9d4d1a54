#!/usr/bin/env bash
# The trainer on a GPU (issue 60): bench/gpu_trainer.py in one device call, prepared and checked here first.
#
#   bench/gpu_check.sh           the CPU smoke run (below), then the device call to make, as JSON
#   bench/gpu_check.sh --cpu     the CPU smoke run alone: the same bench with --device cpu --tiny, with the packages
#                                the GPU image lacks made unimportable; its files go to $OUT (default: a new folder)
#   bench/gpu_check.sh --call    the device call alone
#
# Wheels to carry: none. bench/gpu_trainer.py imports torch and transformers, and through train.py safetensors and
# requests (vllm_client.py): all in the GPU image (torch, transformers, peft, safetensors). What it lacks of
# requirements.txt (vllm, datasets, math_verify, wandb, gguf) train.py's modules import only inside the functions
# that use them (the server's side, a hub dataset, the math reward, wandb, the GGUF conversion), which the bench never
# calls; the CPU smoke run shows it, with each of them unimportable (an import of one fails there as on the device).
#
# The device call, for the `run` tool of a session lent a GPU (the JSON this script prints has the exact strings):
#   command    the bench under `timeout 450`, its log in $OUT/log.txt, its table and numbers in $OUT/gpu_trainer.md
#              and $OUT/gpu_trainer.json (written after every run: a call cut short keeps the rows it measured);
#              both models (Qwen2.5-0.5B and 1.5B shapes) x {checkpointing on, off, FSDP2}; its time on an
#              H100 is not measured yet (estimated 2-3 minutes; the rows are written as they finish)
#   timeout_s  480; carry: nothing (the working tree has all it needs); kind: left out (an H100 will do)
# Then the table of gpu_trainer.md goes to docs/performance.md ("The trainer on a GPU") with the card, the date and
# the command, and what it finds is fixed (a CUDA-only failure, time / bare above 1.15, memory / bare above 1 with
# checkpointing on).
set -euo pipefail
cd "$(dirname "$0")/.."

GPU_IMAGE_LACKS="vllm datasets math_verify wandb gguf"
DEVICE_COMMAND='set -o pipefail; HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 timeout 450 '
DEVICE_COMMAND+='python3 bench/gpu_trainer.py --out "$OUT" 2>&1 | tee "$OUT/log.txt"'
TIMEOUT_S=480
# Runs a script with the packages named in its first argument unimportable (None in sys.modules), as on the device.
WITHOUT='import runpy, sys
sys.modules.update(dict.fromkeys(sys.argv[1].split()))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")'

cpu_smoke() {
    local python=${PYTHON:-.venv/bin/python}
    [ -x "$python" ] || python=python3
    OUT=${OUT:-$(mktemp -d)}
    mkdir -p "$OUT"
    echo "CPU smoke run: bench/gpu_trainer.py --device cpu --tiny, without $GPU_IMAGE_LACKS; files in $OUT" >&2
    HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 timeout 450 "$python" -c "$WITHOUT" "$GPU_IMAGE_LACKS" bench/gpu_trainer.py \
        --out "$OUT" --device cpu --tiny 2>&1 | tee "$OUT/log.txt"
}

device_call() {
    if [ "${#DEVICE_COMMAND}" -gt 2000 ]; then
        echo "the device command is ${#DEVICE_COMMAND} characters: the run tool takes 2000 at most" >&2
        exit 1
    fi
    python3 -c 'import json, sys; print(json.dumps({"command": sys.argv[1], "timeout_s": int(sys.argv[2]),
                                                    "carry": []}))' "$DEVICE_COMMAND" "$TIMEOUT_S"
}

case "${1:-}" in
    --cpu) cpu_smoke ;;
    --call) device_call ;;
    "") cpu_smoke >&2 && echo "no wheels to carry; the device call:" >&2 && device_call ;;
    *) echo "usage: bench/gpu_check.sh [--cpu | --call]" >&2; exit 2 ;;
esac
