#!/usr/bin/env bash
# schemathesis (PyPI, pinned) against the daemon's own /openapi.json: every check, negative
# data, and the stateful phase over the links it infers. Starts `agentd serve` on the memory
# store with a fixed token on a free loopback port, runs, stops it.
#
#   scripts/schemathesis.sh [MAX_EXAMPLES]     (default 50; SCHEMATHESIS_SEED=N replays a run)
#
# Needs python3 (with venv) and network access to PyPI on the first run (the virtualenv is kept
# under $CARGO_TARGET_DIR/schemathesis-venv). tests/schemathesis/schemathesis.toml says which
# answers count as what, and why.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=4.32.5
TARGET="${CARGO_TARGET_DIR:-target}"
VENV="$TARGET/schemathesis-venv"
if [ ! -x "$VENV/bin/schemathesis" ] || ! "$VENV/bin/schemathesis" --version | grep -q "$VERSION"; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet "schemathesis==$VERSION"
fi
cargo build --quiet --bin agentd
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
TOKEN=schemathesis-token-0123456789
LOG=$(mktemp)
AGENTD_TOKEN=$TOKEN "$TARGET/debug/agentd" serve --listen "127.0.0.1:$PORT" --store memory: >"$LOG" 2>&1 &
DAEMON=$!
trap 'kill "$DAEMON" 2>/dev/null; wait "$DAEMON" 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 1 100); do
  grep -q "listening on" "$LOG" && break
  kill -0 "$DAEMON" 2>/dev/null || { cat "$LOG"; exit 1; }
  sleep 0.1
done
grep -q "listening on" "$LOG" || { echo "agentd did not start"; cat "$LOG"; exit 1; }
SEED=()
[ -n "${SCHEMATHESIS_SEED:-}" ] && SEED=(--seed "$SCHEMATHESIS_SEED")
"$VENV/bin/schemathesis" --no-color --config-file tests/schemathesis/schemathesis.toml run \
  "http://127.0.0.1:$PORT/openapi.json" --checks all \
  -H "Authorization: Bearer $TOKEN" --max-examples "${1:-50}" --workers 1 "${SEED[@]}"
