#!/usr/bin/env bash
# Runs every cargo-fuzz target for the given number of seconds (default 60)
# and prints the executions each one reached. Fails if any target finds a crash.
set -euo pipefail
cd "$(dirname "$0")/../../fuzz"
secs="${1:-60}"
targets=$(cargo +nightly fuzz list)
[ -n "$targets" ] || { echo "fuzz: no targets" >&2; exit 1; }
cargo +nightly fuzz build -O 2>&1 | grep -E "^(error|warning: unused)" || true
for t in $targets; do
    corpus="corpus/$t"
    mkdir -p "$corpus"
    [ -d "seeds/$t" ] && cp -n seeds/"$t"/* "$corpus"/ 2>/dev/null || true
    log=$(mktemp)
    if ! cargo +nightly fuzz run -O "$t" "$corpus" -- -max_total_time="$secs" -print_final_stats=1 >"$log" 2>&1; then
        tail -40 "$log"
        echo "fuzz: $t FAILED" >&2
        exit 1
    fi
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo "?")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo "?")
    echo "fuzz: $t ok, ${execs} executions in ${secs}s, coverage ${cov} edges"
    rm -f "$log"
done
