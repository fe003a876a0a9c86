#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: set-up, the services the tests need, pytest.
# Extra arguments go to pytest (e.g. scripts/test.sh tests/engine -x).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
source scripts/services.sh
ensure_services
ensure_browser

set +e
.venv/bin/python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$status"
