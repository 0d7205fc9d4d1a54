#!/usr/bin/env bash
# The main job on one machine: set up (once), start the vLLM server, train, stop the server.
#   bash run.sh                                  # the embedded defaults: SmolLM2-135M on the arithmetic task
#   bash run.sh --max_steps 50 --beta 0.04       # any train.py flag
#   bash run.sh --dataset shapes                 # the embedded vision task, on a small vision-language model
#   bash run.sh --env calculator                 # tool use: three-digit sums with a calculator (also: guess)
#   SERVER_ARGS="--dtype float32" bash run.sh    # any `vllm serve` flag for the server
# On a GPU machine, run vllm_server.py and torchrun yourself (README: "On GPUs").
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh
PY=.venv/bin/python
# the model the flags run (an embedded task picks its own), with --use_peft the server's LoRA support (the
# adapter alone is pushed: its rank fits), and a KV cache the size of what a step samples at once (not vLLM's
# 2 GiB); --help and flag mistakes are printed here, on stderr
FOUND=$($PY -c 'import contextlib, os, sys, config, vllm_server
sys.argv[0] = "train.py"
with contextlib.redirect_stdout(sys.stderr):
    cfg = config.parse_config(sys.argv[1:])
rank = min(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512, cfg.lora_r) if r >= cfg.lora_r)  # vLLM takes these
kv = vllm_server.step_kv_cache_bytes(cfg, ["--model", cfg.model, "--max-model-len", "2048",
                                           *os.environ.get("SERVER_ARGS", "").split()])  # as bash splits it below
print(cfg.model)
print(f"--enable-lora --max-lora-rank {rank}" if cfg.use_peft and cfg.lora_sync != "merged" else "")
print(f"--kv-cache-memory-bytes {kv}" if kv and "VLLM_CPU_KVCACHE_SPACE" not in os.environ else "")' "$@")
MODEL=$(sed -n 1p <<< "$FOUND")
LORA_ARGS=$(sed -n 2p <<< "$FOUND")
KV_ARGS=$(sed -n 3p <<< "$FOUND")
[ -n "$MODEL" ] || exit 0  # --help
OUT=out
for ((i = 1; i <= $#; i++)); do [ "${!i}" = "--output_dir" ] && { j=$((i + 1)); OUT=${!j}; }; done
mkdir -p "$OUT"
read -r PORT GROUP_PORT < <($PY -c "import utils; print(*utils.free_ports(2))")

# a fresh key for this run, given to both sides in the environment (a command line is visible to every
# local user in /proc): no other program on this machine can use the server or replace its weights
export VLLM_API_KEY=${VLLM_API_KEY:-$($PY -c "import secrets; print(secrets.token_urlsafe(24))")}
echo "starting the vLLM server on 127.0.0.1:$PORT (log: $OUT/server.log)"
setsid $PY vllm_server.py --model "$MODEL" --port "$PORT" --enforce-eager --max-model-len 2048 $LORA_ARGS $KV_ARGS \
  ${SERVER_ARGS:-} >> "$OUT/server.log" 2>&1 &
SERVER_PID=$!
trap 'kill -TERM -- -$SERVER_PID 2>/dev/null || true; wait $SERVER_PID 2>/dev/null || true' EXIT
until $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$PORT/health', timeout=2)" 2>/dev/null; do
  kill -0 $SERVER_PID 2>/dev/null || { echo "the vLLM server exited; its log:"; tail -30 "$OUT/server.log"; exit 1; }
  sleep 2
done
$PY train.py --vllm_server_port "$PORT" --vllm_group_port "$GROUP_PORT" "$@"
