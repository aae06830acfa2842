#!/usr/bin/env bash
# stag against its floor (raw TCP, msync) and its peers (UCX and libfabric
# over TCP), every figure from two processes (server in the background,
# client in the foreground; never --loopback).
#
# ROUNDS rounds; each runs every program once in a fixed order, so every
# figure has ROUNDS samples taken interleaved with all the others (the
# machine may be shared: compare figures measured side by side). Writes
# one markdown table and one JSON file, $OUT/report.{md,json}: per test
# the median over the rounds (min, max), the floor it is held against,
# stag/floor, issue #12's target and whether it is met, the CPU the two
# stag processes burned per second of wall time, and the UCX/libfabric
# figure for the same measurement with its ratio to the floor.
#
#   scripts/bench/bench-peers.sh [--quick] [--no-install]
#
# Knobs (environment): ROUNDS (3), ITERS (20000 latency iterations; a
# tenth for Commit and UCX's Get), BW_ITERS (2000 messages of 1 MiB),
# QP_ITERS (4000 8-byte messages per QP of the 64-QP run; the 256- and
# 1024-QP runs send as many messages in all, but each QP at least
# QP_MIN_ITERS, 1000: eight windows of `stag bw`'s depth of 128, so that a
# QP's first window, which grows its queues and faults in their pages,
# is not most of what the row measures), STREAM_ITERS (50000 8-byte
# messages per floor stream of 8; an eighth of that per stream of 64),
# PROGRESS_MODES ("busy adaptive blocking": each stag run once per mode),
# SCALE_QPS (1024 QPs for `stag scale` and cmtime) and SCALE_IDLE (3 s of
# rest), OUT (target/bench-peers), FI_ADDR (the address libfabric's
# programs use: the host's first global IPv4 address; libfabric's verbs
# provider finds no device for 127.0.0.1, its tcp provider wants a
# non-loopback interface to exist). --quick: one round, few iterations
# (a smoke run, not a measurement).
#
# libfabric's rows: fi_pingpong (send ping-pong, tcp provider) and
# fi_peer.c (built here against libfabric-dev: RMA Write ping-pong, Read,
# FetchAdd, 1 MiB Write/Read bandwidth over FI_EP_RDM), with tcp;ofi_rxm,
# and the same fi_peer over stag0 through verbs;ofi_rxm under `stag run`.
# A run whose client or server fails (a signal too) is logged, listed in
# the report as failed, and its figure left out.
#
# BASE=REV measures a second build beside this tree, in the same run: git
# revision REV is checked out under $TARGET_DIR/bench-base/src (a detached
# worktree, reused while it is at REV) and built there in release. Each
# round then runs every stag row, and the scale and cmtime rows, once per
# build, in an order that alternates from round to round, and the report
# adds a before/after table: per row both medians, the paired ratio
# this/base and whether the two builds' ranges overlap (within noise).
# Rows the base's CLI lacks (`stag scale` before it existed) are n/a.
#
# Needs cargo, gcc, python3, ss; installs ucx-utils, libfabric-bin,
# libfabric-dev and time from Debian unless --no-install (missing peers
# are then reported n/a).
set -euo pipefail

cd "$(dirname "$0")/../.."
# shellcheck source=scripts/lib/common.sh disable=SC1091
source scripts/lib/common.sh

QUICK=0
INSTALL=1
for arg in "$@"; do
    case $arg in
    --quick) QUICK=1 ;;
    --no-install) INSTALL=0 ;;
    *)
        echo "usage: $0 [--quick] [--no-install]" >&2
        exit 2
        ;;
    esac
done
if [[ $QUICK == 1 ]]; then
    ROUNDS=${ROUNDS:-1}
    ITERS=${ITERS:-300}
    BW_ITERS=${BW_ITERS:-50}
    QP_ITERS=${QP_ITERS:-100}
    QP_MIN_ITERS=${QP_MIN_ITERS:-10}
    STREAM_ITERS=${STREAM_ITERS:-2000}
    SCALE_QPS=${SCALE_QPS:-64}
    SCALE_IDLE=${SCALE_IDLE:-0.5}
fi
ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-20000}
BW_ITERS=${BW_ITERS:-2000}
QP_ITERS=${QP_ITERS:-4000}
QP_MIN_ITERS=${QP_MIN_ITERS:-1000}
STREAM_ITERS=${STREAM_ITERS:-50000}
PROGRESS_MODES=${PROGRESS_MODES:-busy adaptive blocking}
SCALE_QPS=${SCALE_QPS:-1024}
SCALE_IDLE=${SCALE_IDLE:-3}
OUT=${OUT:-target/bench-peers}
# Slow round trips (a Commit's msync, UCX's software Get) get fewer.
SLOW_ITERS=$(((ITERS / 10) > 100 ? ITERS / 10 : 100))
SLOW_ITERS=$((SLOW_ITERS < ITERS ? SLOW_ITERS : ITERS))
MIB=1048576

log() { printf '# %s\n' "$*" >&2; }
START=$SECONDS

if [[ $INSTALL == 1 ]]; then
    need=()
    command -v ucx_perftest >/dev/null || need+=(ucx-utils)
    command -v fi_pingpong >/dev/null || need+=(libfabric-bin)
    [[ -e /usr/include/rdma/fabric.h ]] || need+=(libfabric-dev)
    [[ -x /usr/bin/time ]] || need+=(time)
    if ((${#need[@]})); then
        log "installing ${need[*]}"
        export DEBIAN_FRONTEND=noninteractive
        SUDO=""
        [[ $(id -u) == 0 ]] || SUDO=sudo
        $SUDO apt-get update -q >/dev/null
        $SUDO apt-get install -y -q "${need[@]}" >/dev/null
    fi
fi
# A peer that is missing leaves its columns "n/a (did not run)"; say which
# and why up front, so a --no-install run is not read as a full one.
missing=()
command -v ucx_perftest >/dev/null || missing+=("UCX (ucx_perftest, Debian ucx-utils)")
command -v fi_pingpong >/dev/null || missing+=("libfabric's fi_pingpong (libfabric-bin)")
[[ -e /usr/include/rdma/fabric.h ]] ||
    missing+=("libfabric's RMA and atomics (fi_peer.c needs libfabric-dev)")
for m in "${missing[@]}"; do
    log "WARNING: no $m: its figures will be missing"
done
[[ -x /usr/bin/time ]] || {
    echo "bench-peers: needs GNU time (/usr/bin/time; Debian package time)" >&2
    exit 1
}

log "building stag and its plugin (release)"
# The plugin too: `stag run` preloads target/release's libstag_rdmav34.so, and
# a stale one would stand in for this tree under every C program here.
cargo build --release -q -p stag -p stag-rdma
TARGET_DIR=$(cargo metadata --format-version 1 --no-deps |
    python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])')
STAG=$TARGET_DIR/release/stag
export STAG_DEVICE=stag0

BASE=${BASE:-}
BASE_STAG=""
if [[ -n $BASE ]]; then
    base_rev=$(git rev-parse --verify "$BASE^{commit}")
    base_src=$TARGET_DIR/bench-base/src
    if [[ $(git -C "$base_src" rev-parse HEAD 2>/dev/null || true) != "$base_rev" ]]; then
        git worktree remove --force "$base_src" 2>/dev/null || rm -rf "$base_src"
        git worktree prune
        git worktree add --detach -q "$base_src" "$base_rev"
    fi
    log "building the base, $BASE ($(git -C "$base_src" describe --always)), in $base_src"
    (cd "$base_src" && CARGO_TARGET_DIR=$TARGET_DIR/bench-base/target \
        cargo build --release -q -p stag -p stag-rdma)
    BASE_STAG=$TARGET_DIR/bench-base/target/release/stag
fi

mkdir -p "$OUT"
RAW=$OUT/raw
rm -rf "$RAW"
mkdir -p "$RAW"
gcc -O2 -Wall -o "$RAW/floor_check" scripts/bench/floor_check.c
CHECK=$RAW/floor_check
FI_PEER=""
if [[ -e /usr/include/rdma/fabric.h ]]; then
    gcc -O2 -Wall -o "$RAW/fi_peer" scripts/bench/fi_peer.c -lfabric
    FI_PEER=$RAW/fi_peer
fi
FI_ADDR=${FI_ADDR:-$(ip -4 -o addr show scope global 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')}

# `stag lat|bw --progress` once the provider has progress modes; the
# environment variable says the same to a provider that reads it.
PROGRESS_FLAG=0
"$STAG" lat --help | grep -q -- '--progress' && PROGRESS_FLAG=1
BASE_PROGRESS_FLAG=0
[[ -n $BASE_STAG ]] && "$BASE_STAG" lat --help | grep -q -- '--progress' && BASE_PROGRESS_FLAG=1

PORT=15000
# run_pair NAME ROUND -- SERVER... -- CLIENT...: the server in the
# background (waited for on its port), the client in the foreground, each
# under GNU time. The client's stdout goes to $RAW/ROUND/NAME.out, the
# CPU figures ("wall user sys") to NAME.{client,server}.time. Servers and
# clients get the port through @PORT@ in their arguments. A failed run
# (the client's exit status not 0, or either side killed by a signal)
# leaves no NAME.out, and the two statuses in NAME.failed.
# kill_tree PID: SIGTERM to PID and every descendant, leaves first.
kill_tree() {
    local child
    for child in $(pgrep -P "$1" 2>/dev/null); do
        kill_tree "$child"
    done
    kill "$1" 2>/dev/null || true
}

run_pair() {
    local name=$1 round=$2
    shift 3
    local srv=() cli=()
    while [[ $1 != -- ]]; do
        srv+=("$1")
        shift
    done
    shift
    cli=("$@")
    PORT=$((PORT + 1))
    local dir=$RAW/$round
    mkdir -p "$dir"
    srv=("${srv[@]//@PORT@/$PORT}")
    cli=("${cli[@]//@PORT@/$PORT}")
    timeout 180 /usr/bin/time -f '%e %U %S' -o "$dir/$name.server.time" \
        "${srv[@]}" >"$dir/$name.server" 2>&1 &
    local spid=$!
    if ! wait_port "$PORT"; then
        log "$name: server did not listen (see $dir/$name.server)"
        kill "$spid" 2>/dev/null || true
        wait "$spid" 2>/dev/null || true
        return 0
    fi
    local crc=0 src=0
    timeout 180 /usr/bin/time -f '%e %U %S' -o "$dir/$name.client.time" \
        "${cli[@]}" >"$dir/$name.out" 2>"$dir/$name.err" || crc=$?
    if ((crc != 0)); then
        kill "$spid" 2>/dev/null || true
    elif [[ ${SERVER_RUNS_ON:-0} == 1 ]]; then
        # A server that never exits by design (rdmacm-utils 44's cmtime
        # server loops on rdma_get_cm_event until an error): its client
        # is done, so the whole tree goes, as a user would stop it.
        kill_tree "$spid"
    fi
    wait "$spid" 2>/dev/null || src=$?
    [[ ${SERVER_RUNS_ON:-0} == 1 ]] && src=0
    # GNU time says "Command terminated by signal N" for a crash.
    # A server stopped by kill_tree above was killed on purpose.
    local crashed watched=("$dir/$name.client.time" "$dir/$name.server.time")
    [[ ${SERVER_RUNS_ON:-0} == 1 ]] && watched=("$dir/$name.client.time")
    crashed=$(grep -h 'terminated by signal' "${watched[@]}" 2>/dev/null || true)
    if ((crc != 0)) || [[ -n $crashed ]]; then
        log "$name failed: client $crc, server $src $crashed (see $dir/$name.err, $dir/$name.server)"
        printf 'client %s server %s %s\n' "$crc" "$src" "$crashed" >"$dir/$name.failed"
        rm -f "$dir/$name.out"
    fi
}

# The builds measured, as "TAG:STAG:PROGRESS_FLAG": this tree (tag stag),
# and with BASE the base (tag base). BUILDS_NOW is the order of the current
# round: the two alternate from round to round.
BUILDS=("stag:$STAG:$PROGRESS_FLAG")
[[ -n $BASE_STAG ]] && BUILDS+=("base:$BASE_STAG:$BASE_PROGRESS_FLAG")
BUILDS_NOW=("${BUILDS[@]}")

# stag_pair NAME ROUND MODE lat|bw OP ARGS...: a stag benchmark with
# progress mode MODE on both sides, once per build back to back, as run
# TAG-NAME (stag-NAME for this tree, base-NAME for the base).
stag_pair() {
    local name=$1 round=$2 mode=$3 test=$4 op=$5
    shift 5
    local build tag bin has_flag flag
    for build in "${BUILDS_NOW[@]}"; do
        IFS=: read -r tag bin has_flag <<<"$build"
        flag=()
        [[ $has_flag == 1 ]] && flag=(--progress "$mode")
        STAG_PROGRESS=$mode run_pair "$tag-$name" "$round" -- \
            "$bin" "$test" "$op" -p @PORT@ "${flag[@]}" -- \
            "$bin" "$test" "$op" 127.0.0.1 -p @PORT@ "${flag[@]}" --json "$@"
    done
}

one_round() {
    local r=$1
    log "round $r/$ROUNDS: floor"
    run_pair floor-lat-busy "$r" -- "$STAG" floor lat -p @PORT@ -- \
        "$STAG" floor lat 127.0.0.1 -p @PORT@ -s 8 -n "$ITERS" --json
    run_pair floor-lat-blocking "$r" -- "$STAG" floor lat -p @PORT@ --mode blocking -- \
        "$STAG" floor lat 127.0.0.1 -p @PORT@ -s 8 -n "$ITERS" --mode blocking --json
    for m in busy blocking; do
        run_pair "floor-bw-$m" "$r" -- "$STAG" floor bw -p @PORT@ --mode "$m" -- \
            "$STAG" floor bw 127.0.0.1 -p @PORT@ -s "$MIB" -n "$BW_ITERS" --mode "$m" --json
        run_pair "floor-streams8-$m" "$r" -- "$STAG" floor bw -p @PORT@ --mode "$m" -- \
            "$STAG" floor bw 127.0.0.1 -p @PORT@ -s 8 -n "$STREAM_ITERS" --streams 8 \
            --mode "$m" --json
        run_pair "floor-streams64-$m" "$r" -- "$STAG" floor bw -p @PORT@ --mode "$m" -- \
            "$STAG" floor bw 127.0.0.1 -p @PORT@ -s 8 -n "$((STREAM_ITERS / 8))" --streams 64 \
            --mode "$m" --json
    done
    for m in busy blocking; do
        run_pair "c-lat-$m" "$r" -- "$CHECK" lat server @PORT@ 8 "$ITERS" "$m" -- \
            "$CHECK" lat client @PORT@ 8 "$ITERS" "$m"
        run_pair "c-bw-$m" "$r" -- "$CHECK" bw server @PORT@ "$MIB" "$BW_ITERS" "$m" -- \
            "$CHECK" bw client @PORT@ "$MIB" "$BW_ITERS" "$m"
    done
    mkdir -p "$RAW/$r"
    "$STAG" floor msync -s 8 -n "$SLOW_ITERS" --json >"$RAW/$r/msync.out"

    BUILDS_NOW=("${BUILDS[@]}")
    if ((${#BUILDS[@]} == 2 && r % 2 == 0)); then
        BUILDS_NOW=("${BUILDS[1]}" "${BUILDS[0]}")
    fi
    for mode in $PROGRESS_MODES; do
        log "round $r/$ROUNDS: stag${BASE_STAG:+ and base}, progress $mode"
        for op in write send read fetch-add cmp-swap swap; do
            stag_pair "$mode-lat-$op" "$r" "$mode" lat "$op" -s 8 -n "$ITERS"
        done
        stag_pair "$mode-lat-commit" "$r" "$mode" lat commit -s 8 -n "$SLOW_ITERS"
        stag_pair "$mode-lat-send-blocking" "$r" "$mode" lat send -s 8 -n "$ITERS" --blocking
        for op in write read; do
            stag_pair "$mode-bw-$op" "$r" "$mode" bw "$op" -s "$MIB" -n "$BW_ITERS"
            # What the MPA CRC costs (kernel siw asks for none by default).
            stag_pair "$mode-bw-$op-nocrc" "$r" "$mode" bw "$op" -s "$MIB" -n "$BW_ITERS" --no-crc
        done
        stag_pair "$mode-bw-write-qps64" "$r" "$mode" bw write -s 8 -n "$QP_ITERS" --qps 64
        for n in 256 1024; do
            per_qp=$((QP_ITERS * 64 / n))
            ((per_qp < QP_MIN_ITERS)) && per_qp=$QP_MIN_ITERS
            stag_pair "$mode-bw-write-qps$n" "$r" "$mode" bw write -s 8 -n "$per_qp" --qps "$n"
        done
    done

    log "round $r/$ROUNDS: scale ($SCALE_QPS QPs)"
    # Memory per idle QP, idle CPU and the connect rate through verbs
    # (stag scale, the provider's default progress); the connect rate
    # through rdma_cm (rdmacm-utils' cmtime under stag run). This tree's
    # runs are named scale and cmtime, the base's base-scale and
    # base-cmtime.
    local build tag bin pre
    for build in "${BUILDS_NOW[@]}"; do
        IFS=: read -r tag bin _ <<<"$build"
        pre=""
        [[ $tag == base ]] && pre=base-
        if "$bin" scale --help >/dev/null 2>&1; then
            run_pair "${pre}scale" "$r" -- "$bin" scale -p @PORT@ --json -- \
                "$bin" scale 127.0.0.1 -p @PORT@ --qps "$SCALE_QPS" --idle "$SCALE_IDLE" --json
        fi
        if command -v cmtime >/dev/null; then
            SERVER_RUNS_ON=1 run_pair "${pre}cmtime" "$r" -- \
                "$bin" run cmtime -b 127.0.0.1 -p @PORT@ -c "$SCALE_QPS" -- \
                "$bin" run cmtime -s 127.0.0.1 -p @PORT@ -c "$SCALE_QPS"
        fi
    done

    if command -v ucx_perftest >/dev/null; then
        log "round $r/$ROUNDS: UCX (UCX_TLS=tcp)"
        local t
        for t in "ucp_get 8 $SLOW_ITERS" "ucp_am_lat 8 $ITERS" "ucp_fadd 8 $ITERS" \
            "ucp_cswap 8 $ITERS" "ucp_swap 8 $ITERS" "ucp_put_bw $MIB $BW_ITERS"; do
            read -r test size n <<<"$t"
            UCX_TLS=tcp run_pair "ucx-$test" "$r" -- ucx_perftest -p @PORT@ -- \
                ucx_perftest 127.0.0.1 -p @PORT@ -t "$test" -s "$size" -n "$n" -w 100 -f
        done
    fi
    if command -v fi_pingpong >/dev/null; then
        log "round $r/$ROUNDS: libfabric (tcp provider)"
        # Send/receive ping-pong on connected (msg) endpoints; the
        # package has no RMA, atomic or streaming test.
        run_pair fi-pingpong-msg "$r" -- fi_pingpong -p tcp -e msg -B @PORT@ -I "$ITERS" -S 8 -- \
            fi_pingpong -p tcp -e msg -P @PORT@ -I "$ITERS" -S 8 127.0.0.1
    fi
    if [[ -n $FI_PEER && -n $FI_ADDR ]]; then
        # RMA and atomics (fi_peer.c), over TCP and over stag0. In blocking
        # mode libfabric's verbs provider reads completion events from a
        # non-blocking channel until EAGAIN.
        local prov tag wrap mode
        for prov in tcp verbs; do
            log "round $r/$ROUNDS: libfabric RMA and atomics ($prov;ofi_rxm)"
            tag=fi-$prov wrap=()
            # (not "stag run --": run_pair splits its arguments at "--")
            [[ $prov == verbs ]] && wrap=("$STAG" run)
            fi_peer_pair() {
                local name=$1 m=$2
                shift 2
                run_pair "$name" "$r" -- "${wrap[@]}" "$FI_PEER" -p "$prov;ofi_rxm" -b @PORT@ \
                    "$FI_ADDR" -m "$m" -- \
                    "${wrap[@]}" "$FI_PEER" -p "$prov;ofi_rxm" -P @PORT@ "$FI_ADDR" -m "$m" --json "$@"
            }
            fi_peer_pair "$tag-write" busy write -s 8 -n "$ITERS"
            fi_peer_pair "$tag-read" busy read -s 8 -n "$ITERS"
            fi_peer_pair "$tag-fetch-add" busy fetch-add -n "$ITERS"
            for mode in busy blocking; do
                fi_peer_pair "$tag-bw-write-$mode" "$mode" bw-write -s "$MIB" -n "$BW_ITERS"
                fi_peer_pair "$tag-bw-read-$mode" "$mode" bw-read -s "$MIB" -n "$BW_ITERS"
            done
        done
    fi
}

log "stag $(git describe --always --dirty 2>/dev/null || echo '?'), $ROUNDS round(s), progress modes: $PROGRESS_MODES (flag: $PROGRESS_FLAG)${BASE:+, base $BASE (flag: $BASE_PROGRESS_FLAG)}"
for r in $(seq "$ROUNDS"); do
    one_round "$r"
done
ELAPSED=$((SECONDS - START))

BENCH_BASE=${BASE:+$BASE ($(git -C "$base_src" describe --always))} \
    BENCH_THIS=$(git describe --always --dirty 2>/dev/null || echo '?') \
    python3 scripts/bench/bench-report.py "$RAW" "$OUT" "$ROUNDS" "$PROGRESS_MODES" "$ELAPSED" \
    "ITERS=$ITERS BW_ITERS=$BW_ITERS QP_ITERS=$QP_ITERS QP_MIN_ITERS=$QP_MIN_ITERS STREAM_ITERS=$STREAM_ITERS SLOW_ITERS=$SLOW_ITERS SCALE_QPS=$SCALE_QPS SCALE_IDLE=$SCALE_IDLE" \
    "$PROGRESS_FLAG"
log "wrote $OUT/report.md and $OUT/report.json in ${ELAPSED}s"
