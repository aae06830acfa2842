#!/usr/bin/env bash
# Crash durability of RDMA Commit: N trials (default 50) of a responder
# process owning a file-backed region, kill -9'd right after a Commit
# completes or at a random moment; every committed range must be in the
# file afterwards. Fails on the first trial that loses one.
set -uo pipefail
cd "$(dirname "$0")/../.."
n="${1:-50}"
log=$(mktemp)
STAG_CRASH_TRIALS="$n" cargo test -p stag-provider --test crash -- --nocapture >"$log" 2>&1
rc=$?
grep -E '^crash:|panicked' "$log" || tail -20 "$log"
rm -f "$log"
[ "$rc" -eq 0 ] || { echo "crash-durability: FAILED" >&2; exit 1; }
