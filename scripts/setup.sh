#!/usr/bin/env bash
# Installs everything stag needs to build and test on Debian 12. Idempotent:
# packages already present are not fetched again.
set -euo pipefail

packages=(
    build-essential pkg-config clang libclang-dev
    libibverbs-dev librdmacm-dev ibverbs-utils rdma-core
    iproute2 procps
    curl xz-utils
    perftest rdmacm-utils libfabric-bin qperf fio
    cmake ninja-build libnl-3-dev libnl-route-3-dev libudev-dev
    # scripts/cluster/cluster.sh and scripts/gate/cluster-apps.sh: namespace hosts,
    # Open MPI (mpicc, NetPIPE), qperf, the tgt iSER target and libiscsi.
    iputils-ping util-linux openmpi-bin libopenmpi-dev netpipe-openmpi qperf
    tgt libiscsi-bin libiscsi-dev linux-perf
)

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Rust components for the lint gate.
rustup component add rustfmt clippy >/dev/null 2>&1 || true

# cargo-fuzz (libFuzzer) for the fuzz targets; needs the nightly toolchain.
if [ "${STAG_SKIP_FUZZ:-0}" != 1 ] && ! command -v cargo-fuzz >/dev/null 2>&1; then
    if rustup toolchain list | grep -q nightly; then
        echo "setup: installing cargo-fuzz"
        cargo install --locked cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz
    else
        echo "setup: no nightly toolchain, fuzz targets will not be built" >&2
    fi
fi
echo "setup: ok"
