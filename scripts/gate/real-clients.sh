#!/usr/bin/env bash
# Real RDMA clients on stag0, the way their users run them: Debian's own
# qperf (-cm1, every RC test, waiting on completion channels (-cp 0) and
# polling (-cp 1), ver_rc_compare_swap and ver_rc_fetch_add), fio's rdma
# engine (write, read and send, iodepth 1 and 16), rping in its default event
# mode verifying data, rdmacm-utils' cmtime (1024 connections at once), and
# stag's C programs over librdmacm (cm_stress.c: rdma_cm under load). Each runs as two processes (server and client, one
# for the C programs) over 127.0.0.1 under `stag run`. Nothing is retried:
# a run that fails is a failure. Prints each case with its run time, then
# "real-clients: N passed, M failed", and exits non-zero on any failure.
#
#   scripts/gate/real-clients.sh [--release]   (default: the debug build the gate makes)
set -uo pipefail
cd "$(dirname "$0")/../.."
profile=debug
[[ ${1:-} == --release ]] && profile=release
flag=()
[[ $profile == release ]] && flag=(--release)

cargo build --quiet "${flag[@]}" -p stag -p stag-rdma || exit 1
STAG=$PWD/target/$profile/stag
out=$PWD/target/real-clients
rm -rf "$out" && mkdir -p "$out"
source scripts/lib/common.sh

passed=0 failed=0
# case_run NAME SECONDS RC: record one case (RC 0: passed) with its time;
# a failure shows the tail of the case's logs.
case_run() {
    local name=$1 secs=$2 rc=$3
    if ((rc == 0)); then
        passed=$((passed + 1))
        printf 'ok    %-40s %6.2f s\n' "$name" "$secs"
    else
        failed=$((failed + 1))
        printf 'FAIL  %-40s %6.2f s\n' "$name" "$secs"
        for f in "$out/$name".*.log; do
            [[ -f $f ]] || continue
            echo "---- $f (last 15 lines)"
            tail -n 15 "$f"
        done
    fi
}

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

# qperf: one server (it forks a child per test); each test a client run of
# one second. The result line must be there: qperf prints it only when the
# test ran to its end, and the ver_ tests check every atomic's result.
# The server's child must be gone 5 s after the client: it waits for
# DISCONNECTED, which must reach it even when the client's close sits
# behind Sends that wait for Receives it no longer posts (the 2 s hold
# limit and the 1 s reset on destroy bound that).
qperf_port=22500
# child_of PID COMM: PID's child named COMM.
child_of() {
    local c
    for c in $(pgrep -P "$1"); do
        [[ $(cat "/proc/$c/comm" 2>/dev/null) == "$2" ]] && echo "$c" && return
    done
}
# reaped PID: wait up to 5 s for PID to have no child left.
reaped() {
    local i
    for ((i = 0; i < 100; i++)); do
        [[ -z $(pgrep -P "$1") ]] && return 0
        sleep 0.05
    done
    return 1
}
qperf_suite() {
    timeout 600 "$STAG" run -- qperf -lp "$qperf_port" >"$out/qperf-server.log" 2>&1 &
    local spid=$!
    if ! wait_port "$qperf_port"; then
        case_run qperf-server 0 1
        kill "$spid" 2>/dev/null
        return
    fi
    # timeout -> stag run -> qperf
    local qpid
    qpid=$(child_of "$(child_of "$spid" stag)" qperf)
    [[ -n $qpid ]] || { case_run qperf-server 0 1; kill "$spid" 2>/dev/null; return; }
    local cp t name t0 rc
    for cp in 0 1; do
        # rc_bw, rc_bi_bw and rc_rdma_write_bw (Write with Immediate takes
        # a Receive) post 1024 messages at once and re-post each one's
        # successor on its local completion, while the peer re-posts
        # Receives only after it polled them: the sender runs ahead of
        # the Receives, which InfiniBand absorbs with RNR retries. On
        # stag0 such a message waits for its Receive while the socket is
        # not read (provider/src/qp/receive.rs, `Held`), and the client's
        # disconnect reaches a server that stopped posting as a reset
        # (provider/src/linger.rs).
        for t in rc_lat rc_rdma_write_lat rc_rdma_read_lat rc_rdma_read_bw \
            rc_bw rc_bi_bw rc_rdma_write_bw \
            rc_rdma_write_poll_lat rc_compare_swap_mr rc_fetch_add_mr \
            ver_rc_compare_swap ver_rc_fetch_add; do
            name="qperf-cp$cp-$t"
            t0=$(now)
            rc=0
            timeout 60 "$STAG" run -- qperf -lp "$qperf_port" -cm1 -cp "$cp" -t 1 127.0.0.1 "$t" \
                >"$out/$name.client.log" 2>&1 || rc=$?
            ((rc == 0)) && ! grep -Eq '(latency|bw|msg_rate) += +[0-9.]+' "$out/$name.client.log" && rc=1
            if ! reaped "$qpid"; then
                echo "the server's child still waits for DISCONNECTED" >>"$out/$name.client.log"
                rc=1
                # Not to be counted against the next test.
                pkill -KILL -P "$qpid"
            fi
            case_run "$name" "$(since "$t0")" "$rc"
        done
    done
    kill "$spid" 2>/dev/null
    wait "$spid" 2>/dev/null
}

# fio_case VERB DEPTH: fio's rdma engine, server rw=read, client rw=write
# with --verb VERB; both must exit 0 with no error and the client must
# report its bandwidth.
fio_port=22600
fio_case() {
    local verb=$1 depth=$2 name="fio-$1-qd$2"
    fio_port=$((fio_port + 1))
    local t0 rc=0
    t0=$(now)
    timeout 60 "$STAG" run -- fio --name=srv --ioengine=rdma --port="$fio_port" --rw=read \
        --bs=64k --size=16m >"$out/$name.server.log" 2>&1 &
    local spid=$!
    wait_port "$fio_port" || rc=1
    if ((rc == 0)); then
        timeout 60 "$STAG" run -- fio --name=cli --ioengine=rdma --hostname=127.0.0.1 \
            --port="$fio_port" --verb="$verb" --rw=write --bs=64k --iodepth="$depth" --size=16m \
            >"$out/$name.client.log" 2>&1 || rc=$?
    fi
    wait "$spid" || rc=1
    if ((rc == 0)) && { ! grep -q 'err= 0' "$out/$name.client.log" ||
        ! grep -q 'WRITE: bw=' "$out/$name.client.log"; }; then
        rc=1
    fi
    ((rc == 0)) || kill "$spid" 2>/dev/null
    case_run "$name" "$(since "$t0")" "$rc"
}

# rping in its default mode (completion channel, a CQ thread), verifying
# every ping's data on both sides.
rping_case() {
    local name=rping-events port=22700 t0 rc=0
    t0=$(now)
    timeout 60 "$STAG" run -- rping -s -a 127.0.0.1 -p "$port" -C 500 -V >"$out/$name.server.log" 2>&1 &
    local spid=$!
    wait_port "$port" || rc=1
    if ((rc == 0)); then
        timeout 60 "$STAG" run -- rping -c -a 127.0.0.1 -p "$port" -C 500 -V -v \
            >"$out/$name.client.log" 2>&1 || rc=$?
    fi
    wait "$spid" || rc=1
    ((rc == 0)) && ! grep -q 'ping data: rdma-ping-499: ' "$out/$name.client.log" && rc=1
    ((rc == 0)) || kill "$spid" 2>/dev/null
    case_run "$name" "$(since "$t0")" "$rc"
}

# cmtime (rdmacm-utils): 1024 connections made, disconnected and
# destroyed at once, in three rounds. Its client takes events on a thread
# of its own while its main thread calls rdma_disconnect and
# rdma_destroy_qp, the race that corrupted its heap on stag0 (issue #19).
# Its server loops on rdma_get_cm_event forever by design: it is stopped
# once the client is done.
cmtime_case() {
    local name=cmtime port=22710 t0 rc=0 round
    t0=$(now)
    timeout 120 "$STAG" run -- cmtime -b 127.0.0.1 -p "$port" -c 1024 >"$out/$name.server.log" 2>&1 &
    local spid=$!
    wait_port "$port" || rc=1
    for round in 1 2 3; do
        ((rc == 0)) || break
        timeout 60 "$STAG" run -- cmtime -s 127.0.0.1 -p "$port" -c 1024 \
            >"$out/$name.client.log" 2>&1 || rc=$?
        ((rc == 0)) && ! grep -q '^destroy' "$out/$name.client.log" && rc=1
    done
    kill "$spid" 2>/dev/null
    wait "$spid" 2>/dev/null
    case_run "$name" "$(since "$t0")" "$rc"
}

# c_program NAME SOURCE PATTERN [ARGS...]: build SOURCE against the
# system's libibverbs/librdmacm, run it under stag run; it must exit 0 and
# print PATTERN. More C programs (fault suites) go in c_programs below.
c_program() {
    local name=$1 src=$2 pattern=$3
    shift 3
    local t0 rc=0
    t0=$(now)
    cc -Wall -Wextra -Werror -O1 -Iprovider/plugin/tests/c -o "$out/$name" "$src" -lrdmacm -libverbs -lpthread \
        >"$out/$name.build.log" 2>&1 || rc=1
    if ((rc == 0)); then
        timeout 120 "$STAG" run -- "$out/$name" "$@" >"$out/$name.run.log" 2>&1 || rc=$?
    fi
    ((rc == 0)) && ! grep -Eq "$pattern" "$out/$name.run.log" && rc=1
    case_run "$name" "$(since "$t0")" "$rc"
}

c_programs() {
    c_program cm_stress provider/plugin/src/cm/tests/cm_stress.c \
        'cm_stress: [1-9][0-9]* passed, 0 failed' 2000
}

t_all=$(now)
qperf_suite
# fio's server keeps one Receive at a time for --verb=send: the client's
# Sends wait for them as qperf's do.
for verb in write read send; do
    for depth in 1 16; do
        fio_case "$verb" "$depth"
    done
done
rping_case
cmtime_case
c_programs
printf 'real-clients: %d passed, %d failed (%.1f s)\n' "$passed" "$failed" "$(since "$t_all")"
((failed == 0))
