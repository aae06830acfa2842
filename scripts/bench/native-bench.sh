#!/usr/bin/env bash
# Native against emulated Commit and Atomic Write on kernel rxe0, in one
# Linux 6.12 guest running rdma-core v55 (scripts/vm/rdma-core.sh): `stag lat`
# for each operation natively and with --emulate, alternated, with the
# round trips per operation the client QP counted. Commit runs twice: into
# a file-backed region (the responder's msync is needed either way) and
# into memory (--commit-to-memory: a device FLUSH alone). Prints a table
# of typical latencies, the emulated/native ratio and the round trips.
# TCG timings are slow: read the ratios, not the microseconds.
#
#   scripts/bench/native-bench.sh [-n ITERS] [--rounds N]
set -euo pipefail
cd "$(dirname "$0")/../.."
iters=300 rounds=2
while (($#)); do
    case $1 in
    -n) iters=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    -h | --help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "native-bench: unknown argument $1" >&2; exit 2 ;;
    esac
done
prefix=$(bash scripts/vm/rdma-core.sh)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}/rdma-core-55
export STAG_RDMA_INCLUDE_DIR=$prefix/include STAG_RDMA_LIB=$prefix/lib
cargo build --quiet --release --bin stag
bin=$CARGO_TARGET_DIR/release/stag
out=$(mktemp -d "${TMPDIR:-/tmp}/stag-native-bench.XXXXXX")
trap 'rm -rf "$out"' EXIT
cat >"$out/run.sh" <<EOF
set -u
export LD_LIBRARY_PATH=\$STAG_RDMA_LIB STAG_DEVICE=\$STAG_RXE_DEV
one() { # label args...: "label t_typical round-trips-per-op"
    label=\$1; shift
    log=\$(timeout 300 $bin lat "\$@" --loopback --bind \$STAG_RXE_ADDR -n $iters 2>&1)
    t=\$(echo "\$log" | awk '/^ *[0-9]+ +[0-9]+ /{ t = \$5 } END { print t }')
    rt=\$(echo "\$log" | sed -n 's/^ Round trips *: \([0-9.]*\) per operation.*/\1/p')
    path=\$(echo "\$log" | sed -n 's/^ Operation *: [a-z-]* (\(.*\))$/\1/p')
    [ -n "\$t" ] || { echo "\$log" | tail -n 5 >&2; t=FAILED; }
    echo "\$label|\$t|\$rt|\$path"
}
for r in \$(seq $rounds); do
    one "commit file native" commit
    one "commit file emulated" commit --emulate commit
    one "commit memory native" commit --commit-to-memory
    one "commit memory emulated" commit --commit-to-memory --emulate commit
    one "atomic-write native" atomic-write
    one "atomic-write emulated" atomic-write --emulate atomic-write
done
EOF
scripts/vm/vm.sh --kernel 6.12 --timeout 1200 -- bash "$out/run.sh" >"$out/rows"
# Median of the rounds per label, then the emulated/native ratio.
awk -F'|' '
    { key = $1; n[key]++; t[key, n[key]] = $2; rt[key] = $3; path[key] = $4 }
    function median(k,   i, j, v, m, tmp) {
        m = n[k]
        for (i = 1; i <= m; i++) v[i] = t[k, i]
        for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (v[j] < v[i]) { tmp = v[i]; v[i] = v[j]; v[j] = tmp }
        return v[int((m + 1) / 2)]
    }
    END {
        printf "%-13s %-7s %-9s %12s %8s %12s  %s\n", "op", "target", "path", "t_typ[usec]", "ratio", "RTT/op", "matrix"
        split("commit file|commit memory|atomic-write -", ops, "|")
        for (o = 1; o <= 3; o++) {
            split(ops[o], w, " ")
            base = median(ops[o] " native")
            if (w[2] == "-") base = median("atomic-write native")
            for (p = 1; p <= 2; p++) {
                mode = (p == 1) ? "native" : "emulated"
                k = (w[2] == "-") ? "atomic-write " mode : ops[o] " " mode
                v = median(k)
                printf "%-13s %-7s %-9s %12s %8.2f %12s  %s\n", w[1], w[2], mode, v, (base > 0 ? v / base : 0), rt[k], path[k]
            }
        }
    }' "$out/rows"
