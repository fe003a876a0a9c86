#!/usr/bin/env bash
# Set up this machine (idempotent) and run the platform under supervisord (scripts/supervisord.conf):
# daphne (web), the inference worker, a Celery worker and Celery beat, each restarted when it exits.
# Prints the URL and the demo tenant's API key. Ctrl-C stops everything.
#
#   scripts/run_platform.sh            # settings from the environment (see docs/platform.md)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
# var/ holds secrets (the database, the keys, the logs): its owner's only.
mkdir -p -m 700 var

# The virtual environment, the pinned requirements and (unless another model or the reference
# backend is chosen) the default model, converted once into the cache folder.
skip_model=0
if [ "${BACKEND:-transformers}" = "reference" ] || [ -n "${MODEL_PATH:-}" ]; then skip_model=1; fi
PYTHON="$PY" SKIP_MODEL=$skip_model scripts/setup.sh

redis_answers() {
  .venv/bin/python -c "import redis, sys; redis.Redis.from_url(sys.argv[1]).ping()" "$REDIS_URL" \
    2>/dev/null
}
# supervisord runs the processes (scripts/supervisord.conf); a private redis-server joins them
# (scripts/supervisord-redis.conf) when no Redis answers.
supervisord_include=""
redis_port=""
if ! redis_answers; then
  if command -v redis-server >/dev/null; then
    redis_port=$(.venv/bin/python -c "from urllib.parse import urlparse; import sys; print(urlparse(sys.argv[1]).port or 6379)" "$REDIS_URL")
    echo "No Redis answers at $REDIS_URL; starting a private redis-server on port $redis_port."
    supervisord_include=supervisord-redis.conf
  else
    echo "No Redis answers at $REDIS_URL and redis-server is not installed." >&2
    echo "Install it (Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew install redis)" >&2
    echo "or point REDIS_URL at a running Redis, then run this again." >&2
    exit 1
  fi
fi

if .venv/bin/python -c "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), 1)" \
    "$HOST" "$PORT" 2>/dev/null; then
  echo "Something already listens on $HOST:$PORT (an earlier run?). Stop it, or choose another" >&2
  echo "port: PORT=8001 scripts/run_platform.sh" >&2
  exit 1
fi

# The processes run under supervisord in the foreground (scripts/supervisord.conf): each one
# restarted when it exits, each stopped with its process group and its own grace period. One
# supervisord per folder (its socket is var/supervisord.sock).
CONF=scripts/supervisord.conf
ctl() { .venv/bin/supervisorctl -c "$CONF" "$@"; }
if ctl pid >/dev/null 2>&1; then
  echo "The platform already runs from this folder (supervisord pid $(ctl pid))." >&2
  echo "Stop it first: Ctrl-C where it runs, or .venv/bin/supervisorctl -c $CONF shutdown" >&2
  exit 1
fi

.venv/bin/python manage.py migrate --noinput
.venv/bin/python manage.py collectstatic --noinput >/dev/null
demo=$(.venv/bin/python manage.py ensure_demo_tenant --user 2>/dev/null)
DEMO_KEY=$(echo "$demo" | sed -n 1p)
DEMO_LOGIN=$(echo "$demo" | sed -n 2p)

# The worker needs more than its SHUTDOWN_TIMEOUT_S (default 10 s) to hand its requests back.
worker_stopwaitsecs=$(awk -v t="${SHUTDOWN_TIMEOUT_S:-10}" \
  'BEGIN { s = int(t); if (s < t) s++; print s + 10 }')
# From here on every file made (the logs, supervisord's socket and pid, what the processes
# write) is its owner's only: mode 0600, folders 0700. Files found looser in var/ are tightened
# by every process as it starts (llm_platform.private_files).
umask 077
# Each start begins fresh logs; the previous run's stay beside them as var/<name>.log.1.
for name in daphne worker celery celery-beat redis supervisord; do
  if [ -s "var/$name.log" ]; then mv -f "var/$name.log" "var/$name.log.1"; fi
  : >"var/$name.log"
done

sup_pid=""
stop_all() {
  trap '' INT TERM HUP   # a second Ctrl-C does not cut the shutdown short
  if [ -n "$sup_pid" ] && kill -0 "$sup_pid" 2>/dev/null; then
    echo "Stopping (daphne, Celery, the worker${redis_port:+, Redis})..."
    kill -TERM "$sup_pid" 2>/dev/null || true
    wait "$sup_pid" 2>/dev/null || true
  fi
}
trap stop_all EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

PLATFORM_HOST=$HOST PLATFORM_PORT=$PORT PLATFORM_REDIS_PORT=$redis_port \
  PLATFORM_SUPERVISORD_INCLUDE=$supervisord_include \
  PLATFORM_WORKER_STOPWAITSECS=$worker_stopwaitsecs \
  .venv/bin/supervisord -c "$CONF" &
sup_pid=$!

# Until the platform is ready: fail fast when supervisord stops, or when a program keeps exiting
# (FATAL: it exited within its start time, startsecs, at each of its tries; or three exits in
# supervisord's log).
check_running() {
  if ! kill -0 "$sup_pid" 2>/dev/null; then
    echo "supervisord stopped; see var/supervisord.log:" >&2
    tail -n 20 var/supervisord.log >&2
    exit 1
  fi
  local failing
  failing=$( { ctl status 2>/dev/null | awk '$2 == "FATAL" { print $1 }'
               awk '$4 == "exited:" && /not expected/ { n[$5]++ }
                    END { for (p in n) if (n[p] >= 3) print p }' var/supervisord.log
             } | head -1)
  if [ -n "$failing" ]; then
    echo "$failing keeps exiting; the end of var/$failing.log:" >&2
    tail -n 20 "var/$failing.log" >&2
    exit 1
  fi
}
if [ -n "$redis_port" ]; then
  for _ in $(seq 50); do redis_answers && break; sleep 0.1; done
  redis_answers || { check_running; echo "The private redis-server does not answer; see var/redis.log" >&2; exit 1; }
fi

echo "Waiting for the worker to load the model..."
for i in $(seq 600); do
  if curl -fs "http://$HOST:$PORT/readyz" >/dev/null 2>&1; then break; fi
  if [ $((i % 4)) = 0 ]; then check_running; fi
  sleep 0.5
done
curl -fs "http://$HOST:$PORT/readyz" >/dev/null || { echo "not ready; see var/*.log" >&2; exit 1; }

cat <<MSG

The platform is running at http://$HOST:$PORT/
  OpenAI base URL: http://$HOST:$PORT/v1
  Demo API key:    $DEMO_KEY
  Demo login:      ${DEMO_LOGIN% *} / ${DEMO_LOGIN#* }  (chat, admin and dashboard)
  Admin:           http://$HOST:$PORT/admin/
  Chat:            http://$HOST:$PORT/chat/   Dashboard: http://$HOST:$PORT/admin/scheduler/
  Logs:            var/daphne.log var/worker.log var/celery.log var/celery-beat.log
  Processes:       .venv/bin/supervisorctl -c $CONF status   (restart worker, tail -f daphne, ...)
Try: curl http://$HOST:$PORT/v1/chat/completions -H "Authorization: Bearer $DEMO_KEY" \\
       -H 'Content-Type: application/json' \\
       -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'
Ctrl-C stops it.
MSG
# supervisord restarts a process that exits; this returns when supervisord itself stops.
wait "$sup_pid"
