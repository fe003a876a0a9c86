#!/usr/bin/env bash
# Source this file: `ensure_services` makes sure Redis (REDIS_URL) answers and, when
# DATABASE_URL names a local PostgreSQL, that it answers too.

redis_answers() {
  .venv/bin/python - "$1" <<'PY' >/dev/null 2>&1
import sys, redis
redis.Redis.from_url(sys.argv[1], socket_connect_timeout=1).ping()
PY
}

ensure_redis() {
  local url=${REDIS_URL:-redis://127.0.0.1:6379/0}
  if redis_answers "$url"; then
    return 0
  fi
  if command -v redis-server >/dev/null 2>&1; then
    local port
    port=$(.venv/bin/python -c "from urllib.parse import urlparse; import sys; print(urlparse(sys.argv[1]).port or 6379)" "$url")
    echo "==> no Redis answers at $url: starting a private redis-server on port $port"
    mkdir -p var
    redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
      --dir "$PWD/var" --logfile "$PWD/var/redis.log" --pidfile "$PWD/var/redis.pid"
    for _ in $(seq 50); do
      redis_answers "$url" && return 0
      sleep 0.1
    done
  fi
  echo "No Redis answers at $url and none could be started." >&2
  echo "Install one (Debian: apt-get install redis-server) or set REDIS_URL to a running Redis." >&2
  return 1
}

ensure_postgres() {
  case "${DATABASE_URL:-}" in
    postgres://*@127.0.0.1*|postgres://*@localhost*|postgresql://*@127.0.0.1*|postgresql://*@localhost*) ;;
    *) return 0 ;;
  esac
  if pg_isready -h 127.0.0.1 -q 2>/dev/null; then
    return 0
  fi
  if command -v pg_ctlcluster >/dev/null 2>&1; then
    echo "==> starting the local PostgreSQL cluster"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start || true
    for _ in $(seq 50); do
      pg_isready -h 127.0.0.1 -q && return 0
      sleep 0.2
    done
  fi
  echo "DATABASE_URL=$DATABASE_URL does not answer; start PostgreSQL or unset DATABASE_URL" >&2
  return 1
}

ensure_browser() {
  # Debian's Chromium and its driver, for the browser tests (never a downloaded browser).
  if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    return 0
  fi
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> installing chromium and chromium-driver for the browser tests"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      chromium chromium-driver fonts-dejavu-core >/dev/null
  else
    echo "Chromium is missing: the browser tests will be skipped" \
         "(Debian: sudo apt-get install chromium chromium-driver)." >&2
  fi
}

ensure_services() {
  ensure_redis
  ensure_postgres
}
