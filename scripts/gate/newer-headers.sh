#!/usr/bin/env bash
# Build stag against a newer rdma-core's headers than the machine runs
# (Debian trixie's libibverbs-dev, which has ibv_wr_flush and
# IBV_QP_EX_WITH_FLUSH; Debian 12 runs rdma-core 44, which has neither),
# then run the result in the test VM on rxe0 against the old library. The
# build-time gate compiles the FLUSH path in; the run-time gate (a QP created
# with a send_ops flag is the proof that the library's ibv_qp_ex has the
# member behind it) must keep every call through a member the running
# library lacks out of reach: the capability report says the provider
# library refuses IBV_QP_EX_WITH_FLUSH, and the verbs operations test and
# ibv_loopback pass. Prints "newer-headers: ok" or exits non-zero.
#
# The headers come from Debian's archive (its Packages index names the
# current files) and are cached next to the VM kernels.
set -euo pipefail
cd "$(dirname "$0")/../.."

cache=${STAG_VM_CACHE:-${XDG_CACHE_HOME:+$XDG_CACHE_HOME/stag-vm}}
cache=${cache:-/var/cache/stag-vm}/trixie-headers
mirror=${STAG_DEBIAN_MIRROR:-http://deb.debian.org/debian}
include=$cache/root/usr/include

fetch() { # url file
    local i
    for i in 1 2 3; do
        curl -fsS -m 120 -o "$2.part" "$1" && mv "$2.part" "$2" && return 0
        sleep $((i * 5))
    done
    echo "newer-headers: cannot download $1" >&2
    return 1
}

if [[ ! -e $cache/.ready ]]; then
    rm -rf "$cache" && mkdir -p "$cache/root"
    fetch "$mirror/dists/trixie/main/binary-amd64/Packages.xz" "$cache/Packages.xz"
    for pkg in libibverbs-dev librdmacm-dev linux-libc-dev; do
        file=$(xz -dc "$cache/Packages.xz" |
            awk -v p="$pkg" '$1 == "Package:" { hit = ($2 == p) } hit && $1 == "Filename:" { f = $2 } END { print f }')
        [[ -n $file ]] || { echo "newer-headers: $pkg not in trixie's index" >&2; exit 1; }
        fetch "$mirror/$file" "$cache/$pkg.deb"
        dpkg-deb -x "$cache/$pkg.deb" "$cache/root"
    done
    touch "$cache/.ready"
fi
grep -q 'wr_flush' "$include/infiniband/verbs.h" || {
    echo "newer-headers: $include has no ibv_wr_flush" >&2
    exit 1
}

target=target/newer-headers
echo "== building against $(sed -n 's/^Version: //p' <(dpkg-deb -f "$cache/libibverbs-dev.deb")) headers"
STAG_RDMA_INCLUDE_DIR=$include CARGO_TARGET_DIR=$target \
    cargo build --quiet --bin stag --tests -p stag -p stag-verbs -p rdma-sys-ext
grep -qh 'rustc-cfg=has_ibv_wr_flush' "$target"/debug/build/rdma-sys-ext-*/output ||
    { echo "newer-headers: the build did not see ibv_wr_flush" >&2; exit 1; }
# The test executables, newest of each name.
exe() { ls -t "$target"/debug/deps/"$1"-* | grep -v '\.d$' | head -n1; }
cat >"$target/run.sh" <<EOF
set -u
echo "== running on libibverbs \$(dpkg-query -W -f='\${Version}' libibverbs1)"
m=\$($target/debug/stag devices -v 2>&1 | sed -n '/^rxe0/,/^siw0/p')
echo "\$m" | grep -E 'posts with|commit'
echo "\$m" | grep -q 'refuses IBV_QP_EX_WITH_FLUSH' || { echo 'newer-headers: the report does not say FLUSH was refused'; exit 1; }
export STAG_DEVICE=\$STAG_RXE_DEV STAG_ADDR=\$STAG_RXE_ADDR STAG_IBV_DEVICE=\$STAG_RXE_DEV STAG_IBV_ADDR=\$STAG_RXE_ADDR
run() { # the test's verdict, with its summary (and ibv_loopback's flush line)
    local log rc
    log=\$(mktemp)
    "\$@" >"\$log" 2>&1
    rc=\$?
    grep -E '^flush|^test result' "\$log"
    rm -f "\$log"
    return \$rc
}
run $(exe operations) --test-threads=1 || exit 1
run $(exe ibv_loopback) --ignored --nocapture --test-threads=1 || exit 1
echo "newer-headers: ok"
EOF
scripts/vm/vm.sh --kernel 6.12 -- bash "$target/run.sh"
