#!/usr/bin/env bash
# Rerun every serving experiment and micro-benchmark in one invocation, in the order and with the
# settings of the figures in docs/benchmarks.md and docs/engine.md (python -m benchmarks.run_all),
# each step's results in its own folder under benchmarks/results/rerun-<full|quick>-<time>/.
#
#   scripts/benchmarks.sh                 # everything, the docs' settings: several hours on 2 cores
#   scripts/benchmarks.sh --quick         # every step at its smallest size: a smoke run of minutes
#   scripts/benchmarks.sh --list          # the commands, not run
#   scripts/benchmarks.sh --only prefill,engine --out-dir /tmp/rerun
#
# Before a run it prepares the default model's folder (python -m inference.worker.prepare_model)
# and makes sure a Redis answers at REDIS_URL (scripts/services.sh); set-up itself is
# scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}

case " $* " in
  *" --list "*|*" -h "*|*" --help "*) ;;
  *)
    source scripts/services.sh
    ensure_redis
    "$PY" -m inference.worker.prepare_model >/dev/null
    ;;
esac
exec "$PY" -m benchmarks.run_all "$@"
