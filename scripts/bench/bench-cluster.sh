#!/usr/bin/env bash
# stag0 across hosts against the same stacks without stag (not in the
# gate): network-namespace hosts (scripts/cluster/cluster.sh), ROUNDS rounds, each
# running every measurement once in a fixed order, so every figure has
# ROUNDS samples taken side by side with its control. Reports medians and
# each stag0 figure as a ratio to its control:
#
#   - NetPIPE (NPopenmpi, 2 hosts): latency at 8 B and bandwidth at 1 MiB,
#     Open MPI pml cm / mtl ofi over verbs;ofi_rxm on stag0, against the
#     same over tcp;ofi_rxm and against pml ob1 / btl tcp. NetPIPE's
#     output file holds, per size: bytes, Mbit/s, and the one-way time in
#     seconds (half of the measured round trip); latency here is that
#     one-way time in microseconds.
#   - allreduce (scripts/cluster/allreduce_time.c, 8 hosts): microseconds
#     per MPI_Allreduce at 8 B and 1 MiB, the same three stacks.
#   - iscsi-perf (tgtd with a 256 MiB LUN on one host, libiscsi on another):
#     IOPS and MB/s over iSER on stag0 against iSCSI/TCP from the same tgtd.
#
# Targets (issue #23): NetPIPE on stag0 within 1.15x of tcp;ofi_rxm at 8 B
# (latency ratio <= 1.15) and >= 0.9x at 1 MiB; iSER MB/s >= iSCSI/TCP.
#
#   scripts/bench/bench-cluster.sh [--json] [--quick]
#
# ROUNDS (3), OUT (target/bench-cluster), PROFILE (release: the stag and
# plugin measured; debug is what cluster-apps.sh runs). --json prints the report as JSON
# on stdout (it is always written to $OUT/report.json). --quick: one round.
# Needs root; scripts/setup.sh installs what it runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
JSON=0
ROUNDS=${ROUNDS:-3}
for arg in "$@"; do
    case $arg in
    --json) JSON=1 ;;
    --quick) ROUNDS=1 ;;
    *)
        echo "usage: $0 [--json] [--quick]" >&2
        exit 2
        ;;
    esac
done
[ "$(id -u)" -eq 0 ] || {
    echo "bench-cluster: needs root (network namespaces)" >&2
    exit 2
}
log() { echo "bench-cluster: $*" >&2; }

# A release build: a debug plugin spends the 1 MiB runs in unoptimised
# CRC32c and copies (PROFILE=debug measures that one).
PROFILE=${PROFILE:-release}
if [ "$PROFILE" = release ]; then
    cargo build --quiet --release -p stag -p stag-rdma || exit 1
else
    cargo build --quiet -p stag -p stag-rdma || exit 1
fi
STAG=$ROOT/target/$PROFILE/stag
C=$ROOT/scripts/cluster/cluster.sh
OUT=${OUT:-$ROOT/target/bench-cluster}
RAW=$OUT/raw
rm -rf "$OUT"
mkdir -p "$RAW"
mpicc -O2 -Wall -Werror -o "$OUT/allreduce_time" scripts/cluster/allreduce_time.c || exit 1

P=${STAG_CLUSTER_PREFIX:-bench}
export STAG_CLUSTER_PREFIX=$P
HOSTS=8
bash "$C" up "$HOSTS" >/dev/null || exit 1
LUN=$(mktemp -d /dev/shm/stag-bench-lun.XXXXXX)
TGT_PORT=$((20000 + $$ % 10000))
cleanup() {
    tgt_down
    bash "$C" down >/dev/null 2>&1
    rm -rf "$LUN"
}
trap cleanup EXIT
on() { bash "$C" exec "$P$1" "$2"; }

MPIRUN="mpirun --mca plm_rsh_agent '$C exec' --mca plm_rsh_no_tree_spawn 1 \
--mca oob_tcp_if_include 10.77.0.0/24 --mca btl_tcp_if_include 10.77.0.0/24"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mpi_ofi() {
    echo "env FI_PROVIDER='$1' $2 $MPIRUN --mca pml cm --mca mtl ofi \
--mca mtl_ofi_provider_include '$1' --mca btl ^openib -x FI_PROVIDER"
}
declare -A STACK=(
    [stag]=$(mpi_ofi 'verbs;ofi_rxm' "$STAG run --")
    [ofi_tcp]=$(mpi_ofi 'tcp;ofi_rxm' "")
    [btl_tcp]="$MPIRUN --mca pml ob1 --mca btl tcp,self"
)

# tgtd on host 1 under stag run: IQN:iser (stag0) and IQN:tcp (port 3261)
# on one LUN; see scripts/gate/cluster-apps.sh for why both ACLs.
IQN=iqn.2026-11.org.stag
INITIATOR=$IQN:client
# tgtd runs only for the iscsi-perf samples: an idle stag0 engine in it
# would otherwise share the 2 cores with every other measurement.
tgt_up() {
    truncate -s 256M "$LUN/lun.img"
    on 1 "echo \$\$ >$LUN/stag-run.pid; exec $STAG run -- tgtd -f -C $TGT_PORT \
        --iscsi portal=10.77.0.1:3261" >>"$RAW/tgtd.log" 2>&1 &
    local t="tgtadm -C $TGT_PORT" i
    for i in $(seq 1 100); do
        on 1 "$t --op show --mode sys" >/dev/null 2>&1 && break
        sleep 0.1
    done
    on 1 "$t --lld iser --op new --mode target --tid 1 -T $IQN:iser &&
        $t --lld iser --op new --mode logicalunit --tid 1 --lun 1 -b $LUN/lun.img &&
        $t --lld iser --op bind --mode target --tid 1 -I ALL &&
        $t --lld iser --op bind --mode target --tid 1 -Q $INITIATOR &&
        $t --lld iscsi --op new --mode target --tid 2 -T $IQN:tcp &&
        $t --lld iscsi --op new --mode logicalunit --tid 2 --lun 1 -b $LUN/lun.img &&
        $t --lld iscsi --op bind --mode target --tid 2 -I ALL" >>"$RAW/tgtadm.log" 2>&1
}
# Killed between samples: a clean stop (no session left, targets deleted,
# tgtd exits) needs STAG_CM_TIMEWAIT_EXIT=1 and waiting for the last
# session to end, which scripts/gate/cluster-apps.sh checks; the samples need
# only that tgtd is gone.
tgt_down() {
    local pid
    [ -f "$LUN/stag-run.pid" ] || return 0
    pid=$(pgrep -P "$(cat "$LUN/stag-run.pid")" -x tgtd) && kill -KILL "$pid"
    rm -f "$LUN/stag-run.pid"
    sleep 0.5
}
declare -A ISCSI=(
    [iser]="$STAG run -- iscsi-perf -i $INITIATOR iser://10.77.0.1/$IQN:iser/1"
    [tcp]="iscsi-perf -i $INITIATOR iscsi://10.77.0.1:3261/$IQN:tcp/1"
)

# One sample of each, appended as "KIND STACK VALUE…" to $RAW/samples.
samples=$RAW/samples
: >"$samples"
netpipe() { # STACK ROUND
    local f=$RAW/np-$1-$2.out
    on 1 "timeout 120 ${STACK[$1]} --host ${P}1,${P}2 -np 2 NPopenmpi -p 0 -l 8 -u 1048576 -o $f" \
        >"$RAW/np-$1-$2.log" 2>&1 || {
        log "NetPIPE $1 round $2 failed (see $RAW/np-$1-$2.log)"
        return
    }
    # bytes, Mbit/s, one-way seconds
    awk -v s="$1" '$1 == 8 { printf "np_lat_8 %s %.3f\n", s, $3 * 1e6 }
        $1 == 1048576 { printf "np_bw_1m %s %.1f\n", s, $2 }' "$f" >>"$samples"
}
allreduce() { # STACK ROUND
    local f=$RAW/allreduce-$1-$2.log
    on 1 "timeout 150 ${STACK[$1]} --host $(seq -s, -f "$P%g" 1 "$HOSTS") -np $HOSTS \
        $OUT/allreduce_time" >"$f" 2>&1 || {
        log "allreduce $1 round $2 failed (see $f)"
        return
    }
    awk -v s="$1" '/^allreduce 8 B:/ { print "allreduce_8 " s " " $4 }
        /^allreduce 1048576 B:/ { print "allreduce_1m " s " " $4 }' "$f" >>"$samples"
}
iscsi_perf() { # TRANSPORT ROUND: 5 s of iscsi-perf (one SIGINT ends it)
    local f=$RAW/iscsi-perf-$1-$2.log
    timeout -s KILL 30 bash "$C" exec "${P}2" "${ISCSI[$1]} & job=\$!; sleep 5;
        pkill -INT -P \$job -x iscsi-perf || kill -INT \$job; wait \$job" >"$f" 2>&1 || {
        log "iscsi-perf $1 round $2 failed (see $f)"
        return
    }
    tr '\r' '\n' <"$f" | grep 'iops average' | tail -1 |
        sed -E 's/.*iops average ([0-9]+) \(([0-9]+) MB\/s\).*/\1 \2/' |
        awk -v s="$1" 'NF == 2 { print "iscsi_iops " s " " $1; print "iscsi_mbs " s " " $2 }' >>"$samples"
}

for ((r = 1; r <= ROUNDS; r++)); do
    log "round $r of $ROUNDS"
    for s in stag ofi_tcp btl_tcp; do netpipe "$s" "$r"; done
    for s in stag ofi_tcp btl_tcp; do allreduce "$s" "$r"; done
    if tgt_up; then
        for s in iser tcp; do iscsi_perf "$s" "$r"; done
    else
        log "tgtd setup failed in round $r (see $RAW/tgtadm.log)"
    fi
    tgt_down
done

python3 - "$samples" "$OUT/report.json" "$ROUNDS" <<'PY' >"$OUT/report.md"
import json, statistics, sys
samples, out, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
vals = {}
for line in open(samples):
    kind, stack, v = line.split()
    vals.setdefault(kind, {}).setdefault(stack, []).append(float(v))
def med(kind, stack):
    v = vals.get(kind, {}).get(stack, [])
    return statistics.median(v) if v else None
# (kind, what, unit, stag stack, controls, higher is better, target ratio vs first control)
rows = [
    ("np_lat_8", "NetPIPE latency 8 B (one way)", "us", "stag", ["ofi_tcp", "btl_tcp"], False, 1.15),
    ("np_bw_1m", "NetPIPE bandwidth 1 MiB", "Mbit/s", "stag", ["ofi_tcp", "btl_tcp"], True, 0.9),
    ("allreduce_8", "allreduce 8 B, 8 hosts", "us", "stag", ["ofi_tcp", "btl_tcp"], False, None),
    ("allreduce_1m", "allreduce 1 MiB, 8 hosts", "us", "stag", ["ofi_tcp", "btl_tcp"], False, None),
    ("iscsi_iops", "iscsi-perf IOPS", "IOPS", "iser", ["tcp"], True, None),
    ("iscsi_mbs", "iscsi-perf MB/s", "MB/s", "iser", ["tcp"], True, 1.0),
]
report = {"rounds": rounds, "results": []}
print(f"| measurement | stag0 | control | ratio | target | met |")
print(f"|---|---|---|---|---|---|")
for kind, what, unit, mine, controls, higher, target in rows:
    m = med(kind, mine)
    for i, c in enumerate(controls):
        cv = med(kind, c)
        ratio = m / cv if m is not None and cv else None
        t = target if i == 0 else None
        met = None
        if t is not None and ratio is not None:
            met = ratio >= t if higher else ratio <= t
        report["results"].append({
            "measurement": kind, "what": what, "unit": unit, "stag": m,
            "stag_samples": vals.get(kind, {}).get(mine, []),
            "control": c, "control_value": cv,
            "control_samples": vals.get(kind, {}).get(c, []),
            "ratio": ratio, "higher_is_better": higher, "target": t, "met": met})
        fmt = lambda x: "n/a" if x is None else f"{x:.3g}"
        tt = "" if t is None else (">= " if higher else "<= ") + f"{t}"
        mt = "" if met is None else ("yes" if met else "NO")
        print(f"| {what} ({unit}) | {fmt(m)} | {c}: {fmt(cv)} | {fmt(ratio)} | {tt} | {mt} |")
json.dump(report, open(out, "w"), indent=1)
PY
if ((JSON)); then cat "$OUT/report.json"; else cat "$OUT/report.md"; fi
