#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: set-up, the services the tests need, pytest.
#
# Without arguments it runs two lanes, each printing its slowest tests (--durations) and its time:
#   fast: every test that needs no process of its own, browser or model (-m "not (e2e or model
#         or browser or process)"), spread over one pytest process per CPU core (pytest-xdist:
#         its tests wait on Redis and the database more than they compute); a failure here stops
#         the run;
#   rest: the others (the whole platform as separate processes, a real browser, the real model,
#         a redis-server of a test's own), one at a time: they time heartbeats and passes.
# Extra arguments go to one pytest run instead (e.g. scripts/test.sh tests/engine -x).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
source scripts/services.sh
ensure_services
ensure_browser

FAST='not (e2e or model or browser or process)'
# On PostgreSQL, a statement that waits over two minutes for a lock fails, naming itself, instead
# of holding its test until pytest's timeout (libpq reads PGOPTIONS; SQLite ignores it).
export PGOPTIONS="${PGOPTIONS:--c lock_timeout=120s}"

# run_lane NAME PYTEST_ARGS...: one pytest run; prints its time; returns its status.
run_lane() {
  local name=$1 start=$SECONDS status
  shift
  echo "==> lane '$name': pytest $*"
  set +e
  .venv/bin/python -m pytest "$@"
  status=$?
  set -e
  echo "==> lane '$name' took $((SECONDS - start)) s (pytest exit status $status)"
  if [ "$status" -eq 5 ]; then
    echo "no tests were collected: failing" >&2
    status=1
  fi
  return "$status"
}

if [ "$#" -gt 0 ]; then
  run_lane selected "$@"
  exit
fi
run_lane fast -m "$FAST" -n auto --durations=25 || exit
run_lane rest -m "not ($FAST)" --durations=50
