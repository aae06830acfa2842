#!/usr/bin/env bash
# Sets up the machine and runs stag's whole test gate: format, lints, the test
# suites and a short run of every fuzz target.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
cargo test --workspace --all-targets 2>&1 | tee target/test.log
# The doc tests run separately (all-targets leaves them out).
cargo test --workspace --doc
if command -v cargo-fuzz >/dev/null 2>&1; then
    echo "== fuzz (short)"
    bash scripts/fuzz.sh "${STAG_FUZZ_SECONDS:-10}"
else
    echo "== fuzz: cargo-fuzz not installed, fuzz targets NOT run" >&2
    exit 1
fi
