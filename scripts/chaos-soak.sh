#!/usr/bin/env bash
# kill -9 chaos soak: the chaos test (tests/it/chaos.rs) with many more trials.
#
#   scripts/chaos-soak.sh [TRIALS] [RUNS_PER_TRIAL]     (defaults: 500 trials, 8 runs each)
#   CHAOS_SEED=123 scripts/chaos-soak.sh 50             (replay one kill schedule)
#
# Needs redis-server on PATH (the test starts a private one on a unix socket). The test prints
# its seed first and its figures last (trials, runs, kills, tool attempts, applied effects,
# duplicates, outcome_unknown parks, lost runs, log violations); a failure prints the seed, the
# violated invariant and the tail of the daemon's log.
set -euo pipefail
cd "$(dirname "$0")/.."
export CHAOS_TRIALS="${1:-${CHAOS_TRIALS:-500}}"
export CHAOS_RUNS="${2:-${CHAOS_RUNS:-8}}"
export CI="${CI:-true}"   # a missing redis-server fails instead of skipping
command -v redis-server >/dev/null || { echo "redis-server is not installed" >&2; exit 2; }
exec cargo test --test it chaos:: -- --nocapture --test-threads 1
