#!/usr/bin/env bash
# Set up this machine (idempotent) and run the platform: daphne (web), the inference worker and a
# Celery worker. Prints the URL and the demo tenant's API key. Ctrl-C stops everything.
#
#   scripts/run_platform.sh            # settings from the environment (see docs/platform.md)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
HOST=${HOST:-127.0.0.1}
PORT=${PORT:-8000}
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
mkdir -p var

# The virtual environment, the pinned requirements and (unless another model or the reference
# backend is chosen) the default model, converted once into the cache folder.
skip_model=0
if [ "${BACKEND:-transformers}" = "reference" ] || [ -n "${MODEL_PATH:-}" ]; then skip_model=1; fi
PYTHON="$PY" SKIP_MODEL=$skip_model scripts/setup.sh

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

redis_answers() {
  .venv/bin/python -c "import redis, sys; redis.Redis.from_url(sys.argv[1]).ping()" "$REDIS_URL" \
    2>/dev/null
}
if ! redis_answers; then
  if command -v redis-server >/dev/null; then
    port=$(.venv/bin/python -c "from urllib.parse import urlparse; import sys; print(urlparse(sys.argv[1]).port or 6379)" "$REDIS_URL")
    echo "No Redis answers at $REDIS_URL; starting a private redis-server on port $port."
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
      --dir "$PWD/var" >var/redis.log 2>&1 &
    pids+=($!)
    for _ in $(seq 50); do redis_answers && break; sleep 0.1; done
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

.venv/bin/python manage.py migrate --noinput
.venv/bin/python manage.py collectstatic --noinput >/dev/null
demo=$(.venv/bin/python manage.py ensure_demo_tenant --user 2>/dev/null)
DEMO_KEY=$(echo "$demo" | sed -n 1p)
DEMO_LOGIN=$(echo "$demo" | sed -n 2p)

.venv/bin/python -m inference.worker >var/worker.log 2>&1 &
pids+=($!)
.venv/bin/celery -A llm_platform worker -P solo -l info >var/celery.log 2>&1 &
pids+=($!)
# Celery beat: stats snapshots for the admin dashboard, cleanup of old snapshots and Redis streams.
.venv/bin/celery -A llm_platform beat -l info -s var/celerybeat-schedule >var/celery-beat.log 2>&1 &
pids+=($!)
.venv/bin/daphne -b "$HOST" -p "$PORT" llm_platform.asgi:application >var/daphne.log 2>&1 &
pids+=($!)

echo "Waiting for the worker to load the model..."
for _ in $(seq 600); do
  if curl -fs "http://$HOST:$PORT/readyz" >/dev/null 2>&1; then break; fi
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
Try: curl http://$HOST:$PORT/v1/chat/completions -H "Authorization: Bearer $DEMO_KEY" \\
       -H 'Content-Type: application/json' \\
       -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'
Ctrl-C stops it.
MSG
wait -n "${pids[@]}"
