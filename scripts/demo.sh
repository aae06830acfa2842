#!/usr/bin/env bash
# Sets up the machine, lists the devices with their capability matrix, and
# runs the quickstart: every operation once on the default device
# ($STAG_DEVICE, else the first RDMA device, else stag's userspace provider).
set -euo pipefail
cd "$(dirname "$0")/.."
STAG_SKIP_FUZZ=1 bash scripts/setup.sh
cargo build --release --quiet --bin stag --example quickstart
./target/release/stag devices
echo
./target/release/examples/quickstart
