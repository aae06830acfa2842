#!/usr/bin/env bash
# Real applications on stag0 against the floors they are judged by (issue
# #19, "Done when"): unmodified Debian binaries (qperf, fio, rping,
# perftest) through `stag run`, each as two processes (server, client) on
# 127.0.0.1, beside `stag floor lat --mode blocking` and `stag bw` of the
# same operation and size, in alternating rounds of one run; the median of
# each over the rounds, and their ratios:
#
#   qperf -cm1 rc_lat (event mode, qperf's default)   ≤ 1.5 × blocking TCP one-way
#     three times: where the scheduler puts the processes, then both pinned
#     to one core, then server and client on a core each, each beside the
#     floor in the same placement. A blocking ping-pong is a wake-up per
#     message, and its cost is the placement's: on this 2-vCPU VM the
#     floor runs 6.5 µs with both processes on one core (a wake-up is a
#     context switch there) and 25-30 µs on two (an idle vCPU is woken).
#     Left to the scheduler, the floor lands on one core in some runs and
#     on two in others, so the unpinned row can set one placement against
#     the other; the pinned rows compare like with like. rping too: its
#     shape over plain TCP (rping_shape.c, below) is itself ~7x a blocking
#     round trip on one core, where every wake-up is a context switch.
#   qperf -cm1 rc_rdma_write_poll_lat                 ≤ 1.2 × ib_write_lat -R
#   qperf rc_bw / rc_rdma_write_bw / rc_rdma_read_bw  ≥ 0.8 × stag bw send/write-imm/read (64 KiB)
#     (qperf's rc_rdma_write_bw posts Writes with Immediate: each consumes a
#     Receive and completes at the server, so its floor is `stag bw write-imm`;
#     its ratio to a plain `stag bw write` is printed too, without a target)
#   fio rdma write / read (64 KiB, iodepth 16)        ≥ 0.8 × stag bw write/read (64 KiB)
#   qperf rc_bi_bw, fio rdma send (64 KiB, iodepth 16) against stag bw send (no target: their
#     senders outrun the Receives, which wait for them on stag0)
#   qperf rc_fetch_add_mr / rc_compare_swap_mr, polling (-cp 1)
#                                                     ≥ 0.8 × stag bw fetch-add/cmp-swap msg rate
#   the same in event mode (qperf's default)          ≥ 0.8 × one blocking TCP round trip per op
#     (at depth 1 each atomic waits for its completion on the channel, so a
#     blocking round trip is its floor; the event figure against the busy
#     `stag bw` is printed too, without a target)
#
# at the same queue depth: qperf -cm1 and fio's rdma engine both connect
# with initiator depth 1 (one outstanding Read or atomic), so their Read
# and atomic floors run `stag bw -t 1`; Writes and Sends at any depth.
#   rping -c -C N, per iteration                      ≤ 6 × blocking TCP round trip
#   beside it, without a target: rping's shape over plain TCP
#   (scripts/bench/rping_shape.c: its six messages per iteration, its two
#   threads and semaphore per process, a CQ thread asleep in poll(2) woken
#   for each completion it acts on, and with -e for each signaled Send's
#   too), the least rping's design costs on this machine, in the same unit
#
# Not in the test gate (timings). A run that fails or hangs (LIMIT seconds)
# counts as missing and its cell says so; nothing is retried.
#
#   scripts/bench/bench-apps.sh [--json] [ROUNDS]     (default 3 rounds; STAG_BIN=path/to/stag
#                                               measures that build instead; ONLY=REGEX
#                                               measures only the keys it matches, e.g.
#                                               ONLY='stag\.(send|write|read1?)|qperf\.rc_.*bw|fio\..*')
#
# Each row gives two ratios, each judged against the target: the ratio of
# the two medians, and the paired ratio (the median of each round's own
# ratio, a figure against the floor measured in the same round), which
# holds up where the machine's speed drifts or flips between rounds.
#
# Writes target/bench-apps.{md,json}; prints the table (or the JSON).
set -uo pipefail
cd "$(dirname "$0")/../.."
JSON=0
if [[ ${1:-} == --json ]]; then
    JSON=1
    shift
fi
ROUNDS=${1:-3}
LIMIT=${LIMIT:-90}
# qperf runs each test for this many seconds.
QT=${QT:-3}
RPING_COUNT=${RPING_COUNT:-2000}
# STAG_BIN measures another build (its plugin is the one beside it).
if [[ -z ${STAG_BIN:-} ]]; then
    cargo build --release --quiet -p stag -p stag-rdma
fi
STAG=${STAG_BIN:-$PWD/target/release/stag}
port=24000

source scripts/lib/common.sh
mkdir -p target
SHAPE=target/rping_shape
gcc -O2 -Wall -pthread -o "$SHAPE" scripts/bench/rping_shape.c || exit 1
COPY_PROBE=target/core_copy
gcc -O2 -Wall -pthread -o "$COPY_PROBE" scripts/bench/core_copy.c || exit 1

for prog in qperf fio rping ib_write_lat; do
    command -v "$prog" >/dev/null || {
        echo "bench-apps: $prog is missing (scripts/setup.sh installs it)" >&2
        exit 1
    }
done

# measure KEY RUNNER ARGS...: append RUNNER's figure (run on a fresh port)
# to V[KEY].
declare -A V
measure() {
    local key=$1
    shift
    [[ -n ${ONLY:-} && ! $key =~ ^($ONLY)$ ]] && return
    port=$((port + 1))
    local x
    x=$("$@" "$port" 2>/dev/null) || true
    [[ $x =~ ^[0-9.]+$ ]] || { echo "$key: no result (port $port)" >&2; x=nan; }
    V[$key]+="$x "
}

# serve PORT CMD...: start a server (killed by stop, by its pid) and wait
# for its port.
serve() {
    local p=$1
    shift
    timeout "$LIMIT" "$@" >/dev/null 2>&1 &
    server=$!
    wait_port "$p" || true
}
stop() {
    kill "$server" 2>/dev/null
    wait "$server" 2>/dev/null
}

# Where the processes run. Unset, where the scheduler puts them (as a
# user runs them); `pinned` sets them for one runner: the server's
# processes on one CPU set, the client's on another (taskset, which their
# threads inherit, stag's engine included).
PIN_S=()
PIN_C=()
# pinned SERVER_CPUS CLIENT_CPUS RUNNER ARGS... PORT: RUNNER with its
# server and client pinned (`measure` runs it in a subshell: the pins end
# with it).
pinned() {
    PIN_S=(taskset -c "$1")
    PIN_C=(taskset -c "$2")
    shift 2
    "$@"
}

# floor_lat FIELD PORT: a field (t_avg_us, rtt_avg_us) of the blocking
# TCP ping-pong. The mean, not the median (t_typical): every figure set
# against it is a mean (qperf's latency and rate are its time over its
# messages, rping's iteration is the run over its count), as perftest's
# t_avg is below. The floor's median is ~3 % under its mean here (one
# core: 6.57 against 6.77 µs).
floor_lat() {
    serve "$2" "${PIN_S[@]}" "$STAG" floor lat --mode blocking -p "$2" --bind 127.0.0.1 -n 20000
    timeout "$LIMIT" "${PIN_C[@]}" "$STAG" floor lat --mode blocking -p "$2" -n 20000 127.0.0.1 --json |
        python3 -c "import json,sys; print(json.load(sys.stdin)['results'][0]['$1'])"
    stop
}

# stag_bw OP SIZE DEPTH FIELD PORT: bw_avg_mb_s or msg_rate_mpps of
# `stag bw` (busy-polling, as its floor role asks) with DEPTH operations
# outstanding. A 64 KiB floor moves 4 GiB (BW_ITERS_64K), 1-3 s like the
# programs it judges: this VM's cross-core copy rate flips between two
# levels in phases of 0.5-4 s (core_copy below), and a 0.4 s run caught
# one phase where the program's seconds averaged both.
stag_bw() {
    local iters=${BW_ITERS:-20000}
    (($2 >= 65536)) && iters=${BW_ITERS_64K:-65536}
    serve "$5" "$STAG" bw "$1" -s "$2" -p "$5" --bind 127.0.0.1 -t "$3"
    timeout "$LIMIT" "$STAG" bw "$1" -s "$2" -p "$5" -t "$3" -n "$iters" 127.0.0.1 --json |
        python3 -c "import json,sys; print(json.load(sys.stdin)['results'][0]['$4'])"
    stop
}

# qperf_run TEST PORT [OPTS...]: qperf's figure for TEST in µs, MB/s or
# messages/s, whatever unit it printed.
qperf_run() {
    local t=$1 p=$2
    shift 2
    serve "$p" "${PIN_S[@]}" "$STAG" run -- qperf -lp "$p"
    timeout "$LIMIT" "${PIN_C[@]}" "$STAG" run -- qperf -cm1 -lp "$p" -t "$QT" "$@" 127.0.0.1 "$t" |
        python3 -c '
import re, sys
scale = {"ns": 1e-3, "us": 1, "ms": 1e3, "sec": 1e6, "s": 1e6,
         "B/sec": 1e-6, "KB/sec": 1e-3, "MB/sec": 1, "GB/sec": 1e3,
         "/sec": 1, "K/sec": 1e3, "M/sec": 1e6}
for line in sys.stdin:
    m = re.match(r"\s*(latency|bw|msg_rate)\s*=\s*([0-9.]+)\s*(\S+)", line)
    if m:
        print(float(m.group(2)) * scale[m.group(3)])
        break
'
    stop
}
qperf_lat() { qperf_run "$1" "$2"; }
# qperf_poll TEST PORT: the same test with qperf polling its CQ (-cp 1),
# as `stag bw` polls: the like-for-like case for a message rate.
qperf_poll() { qperf_run "$1" "$2" -cp 1; }
# qperf prints message sizes in its own units: 64K is 65536 bytes.
qperf_bw() { qperf_run "$1" "$2" -m 64K; }

# perftest_lat PROG PORT: t_avg (µs) of PROG -R, 8 bytes: the mean, as
# qperf reports its latency (total time over messages). perftest's
# t_typical is the median, which leaves out the preemptions a loaded
# machine adds to both (t_avg 26 µs against t_typical 6.9 at load 6).
perftest_lat() {
    serve "$2" "$STAG" run -- "$1" -R -d stag0 -p "$2" -n 20000 -s 8
    timeout "$LIMIT" "$STAG" run -- "$1" -R -d stag0 -p "$2" -n 20000 -s 8 127.0.0.1 |
        awk '$1 == 8 && NF >= 6 { print $6 }'
    stop
}

# fio_rdma VERB PORT: fio's rdma engine bandwidth (MB/s), 64 KiB blocks,
# iodepth 16. fio's rdma engine makes the reading job the server and the
# writing job the client; the client's --verb picks the RDMA operation.
# The client's engine sleeps 500 ms after connecting (`usleep(500000)` in
# fio_rdmaio_connect, so that the server can post its Receives) inside
# the job's timed window: a 256 MiB job at 1.6 GB/s is 0.17 s of transfer
# and 0.5 s of that sleep on any device. `--ramp_time=1` leaves the
# connection and the sleep out of the figure; both sides move FIO_SIZE
# (the server counts it for --verb=send): 8 GiB, 2-6 s after the ramp (a
# 2 GiB job's 0.3-1.3 s caught one phase of the copy rate, core_copy).
fio_rdma() {
    serve "$2" "$STAG" run -- fio --name=srv --ioengine=rdma --port="$2" --rw=read \
        --bs=64k --size="${FIO_SIZE:-8g}"
    timeout "$LIMIT" "$STAG" run -- fio --name=cli --ioengine=rdma --hostname=127.0.0.1 \
        --port="$2" --verb="$1" --rw=write --bs=64k --iodepth=16 --size="${FIO_SIZE:-8g}" \
        --ramp_time=1 --output-format=json |
        python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]['write']; print(j['bw'] * 1024 / 1e6 if j['bw'] else 'nan')"
    stop
}

# core_copy PORT: the machine's cross-core copy rate (MB/s) for a second
# (scripts/bench/core_copy.c), beside the bandwidth rows: no target, it
# says which of its two levels a round's figures were taken in. Taken
# after stag bw write and fio write too: a phase can begin during a run
# (2026-11-28, 5 rounds: every figure under 2000 MB/s of fio write, stag
# bw write and qperf rc_rdma_write_bw came in a round whose probe before
# or after read the slow level, whatever the progress mode of fio's
# server).
core_copy() {
    timeout "$LIMIT" "$COPY_PROBE" 1
}

# rping_shape_iter [-e] PORT: µs per iteration of rping's shape over plain
# TCP (rping_shape.c), RPING_COUNT iterations, the connection excluded.
rping_shape_iter() {
    local ev=()
    [[ $1 == -e ]] && ev=(-e) && shift
    serve "$1" "${PIN_S[@]}" "$SHAPE" server "$1" "$RPING_COUNT" "${ev[@]}"
    timeout "$LIMIT" "${PIN_C[@]}" "$SHAPE" client 127.0.0.1 "$1" "$RPING_COUNT" "${ev[@]}"
    wait "$server" 2>/dev/null
}

# rping_iter PORT: µs per iteration of rping -c -C RPING_COUNT (event mode:
# rping waits on its completion channel), connection included.
rping_iter() {
    serve "$1" "${PIN_S[@]}" "$STAG" run -- rping -s -a 127.0.0.1 -p "$1" -C "$RPING_COUNT"
    local t0 t1
    t0=$(date +%s%N)
    timeout "$LIMIT" "${PIN_C[@]}" "$STAG" run -- rping -c -a 127.0.0.1 -p "$1" -C "$RPING_COUNT" >/dev/null &&
        t1=$(date +%s%N) &&
        python3 -c "print(($t1 - $t0) / 1e3 / $RPING_COUNT)"
    stop
}

NCPU=$(nproc)
load_start=$(cut -d' ' -f1-4 /proc/loadavg)
for ((r = 1; r <= ROUNDS; r++)); do
    measure floor.oneway floor_lat t_avg_us
    measure floor.rtt floor_lat rtt_avg_us
    measure qperf.rc_lat qperf_lat rc_lat
    # The blocking floor's two placements, each beside qperf in the same.
    measure floor.oneway_1core pinned 0 0 floor_lat t_avg_us
    measure qperf.rc_lat_1core pinned 0 0 qperf_lat rc_lat
    if ((NCPU >= 2)); then
        measure floor.oneway_2cores pinned 0 1 floor_lat t_avg_us
        measure qperf.rc_lat_2cores pinned 0 1 qperf_lat rc_lat
    fi
    measure qperf.rc_rdma_write_lat qperf_lat rc_rdma_write_lat
    measure qperf.rc_rdma_read_lat qperf_lat rc_rdma_read_lat
    measure qperf.rc_rdma_write_poll_lat qperf_lat rc_rdma_write_poll_lat
    measure perftest.ib_write_lat perftest_lat ib_write_lat
    # qperf -cm1 connects with initiator depth and responder resources 1:
    # one Read or atomic outstanding, so its floors run at depth 1 too.
    measure stag.send stag_bw send 65536 128 bw_avg_mb_s
    measure qperf.rc_bw qperf_bw rc_bw
    measure qperf.rc_bi_bw qperf_bw rc_bi_bw
    measure probe.copy_stag_write core_copy
    measure stag.write stag_bw write 65536 128 bw_avg_mb_s
    measure probe.copy_after_stag_write core_copy
    measure stag.write_imm stag_bw write-imm 65536 128 bw_avg_mb_s
    measure qperf.rc_rdma_write_bw qperf_bw rc_rdma_write_bw
    measure stag.read1 stag_bw read 65536 1 bw_avg_mb_s
    measure qperf.rc_rdma_read_bw qperf_bw rc_rdma_read_bw
    measure probe.copy_fio_write core_copy
    measure fio.write fio_rdma write
    measure probe.copy_after_fio_write core_copy
    measure fio.read fio_rdma read
    measure fio.send fio_rdma send
    measure stag.fetch-add stag_bw fetch-add 8 1 msg_rate_mpps
    measure qperf.rc_fetch_add_mr qperf_lat rc_fetch_add_mr
    measure qperf.rc_fetch_add_mr_poll qperf_poll rc_fetch_add_mr
    measure stag.cmp-swap stag_bw cmp-swap 8 1 msg_rate_mpps
    measure qperf.rc_compare_swap_mr qperf_lat rc_compare_swap_mr
    measure qperf.rc_compare_swap_mr_poll qperf_poll rc_compare_swap_mr
    measure rping.iter rping_iter
    measure rping.shape rping_shape_iter
    measure rping.shape_events rping_shape_iter -e
    measure floor.rtt_1core pinned 0 0 floor_lat rtt_avg_us
    measure rping.iter_1core pinned 0 0 rping_iter
    measure rping.shape_events_1core pinned 0 0 rping_shape_iter -e
    if ((NCPU >= 2)); then
        measure floor.rtt_2cores pinned 0 1 floor_lat rtt_avg_us
        measure rping.iter_2cores pinned 0 1 rping_iter
        measure rping.shape_events_2cores pinned 0 1 rping_shape_iter -e
    fi
    echo "round $r done" >&2
done
load_end=$(cut -d' ' -f1-4 /proc/loadavg)

args=()
for k in "${!V[@]}"; do args+=("$k=${V[$k]}"); done
mkdir -p target
python3 - "$JSON" "$ROUNDS" "${STAG_PROGRESS:-adaptive}" "$load_start" "$load_end" "${args[@]}" <<'PY'
import json, math, statistics, sys
as_json, rounds, progress, load_start, load_end = sys.argv[1:6]
# by_round[k][i]: key k's figure in round i (nan where that run failed),
# so that a program and its floor pair up round by round.
by_round = {}
for a in sys.argv[6:]:
    k, _, xs = a.partition("=")
    by_round[k] = [float(x) for x in xs.split()]
# stag bw's message rate is in millions per second; qperf's in messages.
for op in ("fetch-add", "cmp-swap"):
    if f"stag.{op}" in by_round:
        by_round[f"stag.{op}"] = [x * 1e6 for x in by_round[f"stag.{op}"]]
# In event mode qperf sleeps on its channel once per atomic at depth 1:
# its like-for-like floor is one blocking TCP round trip per operation,
# not a busy poller's rate.
if "floor.rtt" in by_round:
    by_round["floor.rtt_rate"] = [1e6 / x if x > 0 else math.nan for x in by_round["floor.rtt"]]
v = {k: [x for x in xs if not math.isnan(x)] for k, xs in by_round.items()}
med = {k: statistics.median(x) if x else math.nan for k, x in v.items()}

def paired(key, fkey):
    """The median over the rounds of each round's own ratio: a figure and
    its floor measured minutes apart in one round share that round's
    machine (on a VM whose bandwidth flips between two levels from run to
    run, a ratio of medians can set one level against the other)."""
    rs = [m / f for m, f in zip(by_round.get(key, []), by_round.get(fkey, []))
          if not math.isnan(m) and not math.isnan(f) and f]
    return statistics.median(rs) if rs else math.nan

def verdict(r, kind, target):
    """Whether ratio r meets the row's target ("" for a row without one)."""
    if target is None:
        return ""
    if math.isnan(r):
        return "no result"
    return "yes" if (r <= target if kind == "le" else r >= target) else "NO"

def two(r):
    return "" if math.isnan(r) else f"{r:.2f}"

# (name, measured key, floor key, floor name, unit, kind, target): kind
# "le" is a cost (the ratio must stay at or below the target), "ge" a rate.
rows = [
    ("qperf rc_lat (event)", "qperf.rc_lat", "floor.oneway", "TCP blocking one-way", "µs", "le", 1.5),
    ("qperf rc_lat (event), both processes on one core", "qperf.rc_lat_1core", "floor.oneway_1core", "TCP blocking one-way, one core", "µs", "le", 1.5),
    ("qperf rc_lat (event), server and client on two cores", "qperf.rc_lat_2cores", "floor.oneway_2cores", "TCP blocking one-way, two cores", "µs", "le", 1.5),
    ("qperf rc_rdma_write_lat (event)", "qperf.rc_rdma_write_lat", "floor.oneway", "TCP blocking one-way", "µs", "le", None),
    ("qperf rc_rdma_read_lat (event)", "qperf.rc_rdma_read_lat", "floor.rtt", "TCP blocking round trip", "µs", "le", None),
    ("qperf rc_rdma_write_poll_lat", "qperf.rc_rdma_write_poll_lat", "perftest.ib_write_lat", "ib_write_lat -R", "µs", "le", 1.2),
    ("qperf rc_bw 64K (event)", "qperf.rc_bw", "stag.send", "stag bw send 64K", "MB/s", "ge", 0.8),
    ("qperf rc_rdma_write_bw 64K (event)", "qperf.rc_rdma_write_bw", "stag.write_imm", "stag bw write-imm 64K", "MB/s", "ge", 0.8),
    ("qperf rc_rdma_read_bw 64K (event)", "qperf.rc_rdma_read_bw", "stag.read1", "stag bw read 64K -t 1", "MB/s", "ge", 0.8),
    ("fio rdma write 64K qd16", "fio.write", "stag.write", "stag bw write 64K", "MB/s", "ge", 0.8),
    ("fio rdma read 64K qd16", "fio.read", "stag.read1", "stag bw read 64K -t 1", "MB/s", "ge", 0.8),
    ("qperf rc_rdma_write_bw 64K (event) against plain Writes", "qperf.rc_rdma_write_bw", "stag.write", "stag bw write 64K", "MB/s", "ge", None),
    ("qperf rc_bi_bw 64K (event)", "qperf.rc_bi_bw", "stag.send", "stag bw send 64K", "MB/s", "ge", None),
    ("fio rdma send 64K qd16", "fio.send", "stag.send", "stag bw send 64K", "MB/s", "ge", None),
    ("qperf rc_fetch_add_mr (polling, -cp 1)", "qperf.rc_fetch_add_mr_poll", "stag.fetch-add", "stag bw fetch-add -s 8 -t 1", "msg/s", "ge", 0.8),
    ("qperf rc_compare_swap_mr (polling, -cp 1)", "qperf.rc_compare_swap_mr_poll", "stag.cmp-swap", "stag bw cmp-swap -s 8 -t 1", "msg/s", "ge", 0.8),
    ("qperf rc_fetch_add_mr (event)", "qperf.rc_fetch_add_mr", "floor.rtt_rate", "1 / TCP blocking round trip", "msg/s", "ge", 0.8),
    ("qperf rc_compare_swap_mr (event)", "qperf.rc_compare_swap_mr", "floor.rtt_rate", "1 / TCP blocking round trip", "msg/s", "ge", 0.8),
    ("qperf rc_fetch_add_mr (event) against polling", "qperf.rc_fetch_add_mr", "stag.fetch-add", "stag bw fetch-add -s 8 -t 1", "msg/s", "ge", None),
    ("rping -C per iteration (event)", "rping.iter", "floor.rtt", "TCP blocking round trip", "µs", "le", 6.0),
    ("rping's shape over TCP, per iteration", "rping.shape", "floor.rtt", "TCP blocking round trip", "µs", "le", None),
    ("rping's shape over TCP, Send completions raised too", "rping.shape_events", "floor.rtt", "TCP blocking round trip", "µs", "le", None),
    ("rping -C against its shape over TCP (Send completions raised)", "rping.iter", "rping.shape_events", "rping_shape.c -e", "µs", "le", None),
    ("rping -C per iteration (event), both processes on one core", "rping.iter_1core", "floor.rtt_1core", "TCP blocking round trip, one core", "µs", "le", 6.0),
    ("rping's shape over TCP (Send completions raised), one core", "rping.shape_events_1core", "floor.rtt_1core", "TCP blocking round trip, one core", "µs", "le", None),
    ("rping -C against its shape over TCP, one core", "rping.iter_1core", "rping.shape_events_1core", "rping_shape.c -e, one core", "µs", "le", None),
    ("rping -C per iteration (event), server and client on two cores", "rping.iter_2cores", "floor.rtt_2cores", "TCP blocking round trip, two cores", "µs", "le", 6.0),
    ("rping's shape over TCP (Send completions raised), two cores", "rping.shape_events_2cores", "floor.rtt_2cores", "TCP blocking round trip, two cores", "µs", "le", None),
    ("rping -C against its shape over TCP, two cores", "rping.iter_2cores", "rping.shape_events_2cores", "rping_shape.c -e, two cores", "µs", "le", None),
]

def fmt(x):
    if math.isnan(x):
        return "no result"
    return f"{x:.3g}" if x < 100 else f"{x:,.0f}"

def cell(k):
    x = v.get(k, [])
    miss = int(rounds) - len(x)
    extra = f" ({miss} missing)" if miss else ""
    return fmt(med.get(k, math.nan)) + extra

md = ["| program | median | floor | floor median | unit | ratio | paired | target | met | met (paired) |",
      "|---|---:|---|---:|---|---:|---:|---:|---|---|"]
out = []
for name, key, fkey, fname, unit, kind, target in rows:
    if key not in v and fkey not in v:
        continue  # not measured (ONLY)
    m, f = med.get(key, math.nan), med.get(fkey, math.nan)
    ratio = m / f if f and not math.isnan(f) else math.nan
    pr = paired(key, fkey)
    met, met_paired = verdict(ratio, kind, target), verdict(pr, kind, target)
    tgt = "" if target is None else ("≤ " if kind == "le" else "≥ ") + f"{target}"
    md.append(f"| {name} | {cell(key)} | {fname} | {cell(fkey)} | {unit} | "
              f"{two(ratio)} | {two(pr)} | {tgt} | {met} | {met_paired} |")
    out.append({"program": name, "key": key, "floor": fkey, "unit": unit,
                "values": by_round.get(key, []), "floor_values": by_round.get(fkey, []),
                "median": m, "floor_median": f, "ratio": ratio, "paired_ratio": pr,
                "target": target, "kind": kind, "met": met == "yes",
                "met_paired": met_paired == "yes"})
md.append("")
md.append(f"Medians of {rounds} alternating rounds, each program as two processes on "
          f"127.0.0.1 through `stag run` (progress mode {progress}); load average "
          f"{load_start} before, {load_end} after. ratio: the two medians' ratio; "
          f"paired: the median of each round's own ratio (values: per round, in "
          f"the JSON, nan where a run failed).")
probes = [("before stag bw write", "probe.copy_stag_write"),
          ("after it", "probe.copy_after_stag_write"),
          ("before fio rdma write", "probe.copy_fio_write"),
          ("after it", "probe.copy_after_fio_write")]
if any(k in by_round for _, k in probes):
    md.append("")
    md.append("Cross-core copy rate (scripts/bench/core_copy.c, MB/s) per round, "
              + "; ".join(f"{n}: " + " ".join(fmt(x) for x in by_round[k])
                          for n, k in probes if k in by_round)
              + ". The VM's rate flips between ~5000 and ~1500 MB/s with nothing of "
              "ours running; a bandwidth figure taken in the slow phase is ~2.5x lower "
              "for that alone. A slow rate right after a run says the run ended in "
              "that phase.")
text = "\n".join(md)
doc = {"rounds": int(rounds), "progress": progress, "load_start": load_start,
       "load_end": load_end, "rows": out,
       "core_copy_mb_s": {k: by_round[k] for _, k in probes if k in by_round}}
open("target/bench-apps.md", "w").write(text + "\n")
open("target/bench-apps.json", "w").write(json.dumps(doc, indent=2, default=str) + "\n")
print(json.dumps(doc, indent=2, default=str) if as_json == "1" else text)
PY
