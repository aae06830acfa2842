#!/usr/bin/env bash
# Long soak of the userspace provider: 64 QPs over 8 device pairs with
# mixed, verified operations for SECONDS (default 300, or $STAG_SOAK_SECS).
# Prints ops/s and RSS before/after; fails on any lost or corrupted op.
set -uo pipefail
cd "$(dirname "$0")/../.."
secs="${1:-${STAG_SOAK_SECS:-300}}"
log=$(mktemp)
STAG_SOAK_SECS="$secs" cargo test -p stag-provider --release --test soak -- --nocapture >"$log" 2>&1
rc=$?
grep -E '^soak:|panicked|FAILED' "$log" || tail -20 "$log"
rm -f "$log"
[ "$rc" -eq 0 ] || { echo "soak: FAILED" >&2; exit 1; }
