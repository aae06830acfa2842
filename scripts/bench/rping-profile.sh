#!/usr/bin/env bash
# What one rping iteration costs on stag0 (issue #19): Debian's rping in
# event mode (`stag run -- rping -s/-c -C N`, its CQ thread sleeping on the
# completion channel), two processes on 127.0.0.1, beside the blocking TCP
# round trip (`stag floor lat --mode blocking`) measured in the same round.
# Per iteration, the median over ROUNDS alternating rounds of each build:
#
#   us    wall time (connection included)
#   cpu   CPU time of both processes (perf task-clock), in us
#   cs    context switches of both processes
#
# then, from two more runs of each build, every thread's context switches and
# system calls per iteration, and why each thread left the CPU (asleep in
# poll/futex/epoll_wait, or preempted on the way out of a system call by a
# thread it woke: perf record of sched_switch with kernel stacks). perf stat
# --per-thread watches both processes; the iterations counted are the
# server's socket writes / 4 (it sends a Read Request, a Send, a Write and a
# Send per iteration, each one `sendto`, or one `sendmsg` when gathered
# from several buffers). On this 2-core machine
# wall time swings with everyone else's load; CPU time and switches per
# iteration are the steadier figures, and the per-thread table says which
# thread pays them (rping's main thread, its CQ thread, stag's engine).
#
#   scripts/bench/rping-profile.sh [--spin] [ROUNDS]   (default 6 rounds)
#     STAG_BIN=path/to/stag   the build to measure (default target/release/stag,
#                             built first); its plugin is the one beside it
#     BASE_BIN=path/to/stag   a second build, alternated with it round by round
#     RPING_COUNT=N           iterations per run (default 3000)
#     --spin                  two `nice -n 19` busy loops run throughout (cores
#                             kept awake, as under load), killed by PID at the end
#
# Not in the test gate (timings). Needs perf (linux-perf, scripts/setup.sh)
# and root; uses ports 23000-27999, so run it in a network namespace of your
# own when others test on the machine: ip netns exec NAME bash scripts/bench/rping-profile.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
SPIN=0
if [[ ${1:-} == --spin ]]; then
    SPIN=1
    shift
fi
ROUNDS=${1:-6}
COUNT=${RPING_COUNT:-3000}
LIMIT=${LIMIT:-120}
if [[ -z ${STAG_BIN:-} ]]; then
    cargo build --release --quiet -p stag -p stag-rdma || exit 1
fi
NEW=${STAG_BIN:-$PWD/target/release/stag}
BUILDS=("$NEW")
[[ -n ${BASE_BIN:-} ]] && BUILDS=("$BASE_BIN" "$NEW")
for prog in rping perf; do
    command -v "$prog" >/dev/null || {
        echo "rping-profile: $prog is missing (scripts/setup.sh installs it)" >&2
        exit 1
    }
done
source scripts/lib/common.sh
OUT=$(mktemp -d)
SPINNERS=()
cleanup() {
    for p in "${SPINNERS[@]}"; do kill "$p" 2>/dev/null; done
    rm -rf "$OUT"
}
trap cleanup EXIT
if ((SPIN)); then
    for _ in 1 2; do
        nice -n 19 sh -c 'while :; do :; done' &
        SPINNERS+=($!)
    done
fi
port=$((23000 + RANDOM % 40 * 100))
next_port() { port=$((port + 1)); }

# floor_rtt: the blocking TCP round trip, typical, in us.
floor_rtt() {
    next_port
    timeout 60 "$NEW" floor lat --mode blocking -p "$port" --bind 127.0.0.1 -n 20000 >/dev/null 2>&1 &
    local s=$!
    wait_port "$port"
    timeout 60 "$NEW" floor lat --mode blocking -p "$port" -n 20000 127.0.0.1 --json |
        python3 -c "import json,sys; print(json.load(sys.stdin)['results'][0]['rtt_typical_us'])"
    kill "$s" 2>/dev/null
    wait "$s" 2>/dev/null
}

# rping_run STAG: "us cpu cs" per iteration, or "nan nan nan" if it failed.
rping_run() {
    next_port
    perf stat -x, -e task-clock,context-switches -o "$OUT/s" \
        timeout "$LIMIT" "$1" run -- rping -s -a 127.0.0.1 -p "$port" -C "$COUNT" >/dev/null 2>&1 &
    local s=$! t0 t1 rc
    wait_port "$port"
    t0=$(date +%s%N)
    perf stat -x, -e task-clock,context-switches -o "$OUT/c" \
        timeout "$LIMIT" "$1" run -- rping -c -a 127.0.0.1 -p "$port" -C "$COUNT" >/dev/null 2>&1
    rc=$?
    t1=$(date +%s%N)
    wait "$s"
    ((rc == 0)) || { echo "nan nan nan"; return; }
    python3 - "$COUNT" "$t0" "$t1" "$OUT/s" "$OUT/c" <<'PY'
import sys
n, t0, t1 = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
tot = {}
for f in sys.argv[4:6]:
    for line in open(f):
        p = line.split(',')
        if len(p) > 3 and not line.startswith('#'):
            try:
                tot[p[2]] = tot.get(p[2], 0.0) + float(p[0])
            except ValueError:
                pass
print(f"{(t1 - t0) / 1e3 / n:.1f} {tot['task-clock'] * 1e3 / n:.1f} {tot['context-switches'] / n:.2f}")
PY
}

# rping_under PID: the rping process started by `timeout` PID (through stag
# run), once it is there (up to 5 s).
rping_under() {
    local p r
    for _ in $(seq 50); do
        for p in $(pgrep -P "$1"); do
            r=$(pgrep -x -P "$p" rping | head -1)
            [[ -n $r ]] && { echo "$r"; return; }
        done
        sleep 0.1
    done
}

# start_pair STAG: an rping server and client of STAG on a fresh port, in
# the background; sets s and c (their timeout pids) and sp and cp (the
# rping processes under them: ours, not another user's rping), which the
# caller declares local. Fails, with both waited for, if either rping
# was not found.
start_pair() {
    next_port
    timeout "$LIMIT" "$1" run -- rping -s -a 127.0.0.1 -p "$port" -C "$COUNT" >/dev/null 2>&1 &
    s=$!
    wait_port "$port"
    timeout "$LIMIT" "$1" run -- rping -c -a 127.0.0.1 -p "$port" -C "$COUNT" >/dev/null 2>&1 &
    c=$!
    sp=$(rping_under "$s")
    cp=$(rping_under "$c")
    [[ -n $sp && -n $cp ]] || { echo "  (rping not found)"; wait "$c"; wait "$s"; return 1; }
}

# threads STAG: per-thread switches and system calls per iteration, one run.
threads() {
    local ev=context-switches sc
    for sc in futex poll ppoll epoll_wait recvfrom sendto sendmsg write read; do
        ev+=,syscalls:sys_enter_$sc
    done
    local s c sp cp
    start_pair "$1" || return
    perf stat --per-thread -x, -e "$ev" -p "$sp" -o "$OUT/ts" &
    local ps=$!
    perf stat --per-thread -x, -e "$ev" -p "$cp" -o "$OUT/tc" &
    local pc=$!
    wait "$c"
    kill -INT "$ps" "$pc" 2>/dev/null
    wait "$ps" "$pc" 2>/dev/null
    wait "$s"
    python3 - "$OUT/ts" "$OUT/tc" <<'PY'
import collections, sys
def load(f):
    d = collections.defaultdict(dict)
    for line in open(f):
        p = line.strip().split(',')
        if len(p) < 4 or line.startswith('#'):
            continue
        try:
            d[p[0]][p[3].replace('syscalls:sys_enter_', '')] = float(p[1])
        except ValueError:
            pass
    return d
srv, cli = load(sys.argv[1]), load(sys.argv[2])
n = sum(e.get('sendto', 0) + e.get('sendmsg', 0) for e in srv.values()) / 4
if n < 1:
    sys.exit("  (no iteration seen)")
print(f"  {n:.0f} iterations seen")
for side, d in (("server", srv), ("client", cli)):
    for t, evs in sorted(d.items()):
        if sum(evs.values()) >= 0.05 * n:
            print(f"  {side} {t:<22} " + " ".join(f"{k}={v / n:.2f}" for k, v in evs.items() if v / n >= 0.01))
PY
}

# why STAG: why each thread left the CPU, per iteration, one run (perf
# record of sched_switch with kernel stacks): asleep in poll, futex (rping's
# semaphores, or a lock) or epoll_wait, or preempted on the way out of a
# system call (a thread it woke ran in its place) or elsewhere.
why() {
    local s c sp cp
    start_pair "$1" || return
    perf record -q -g -e sched:sched_switch -e syscalls:sys_enter_sendto \
        -e syscalls:sys_enter_sendmsg -p "$sp,$cp" \
        -o "$OUT/why.data" >/dev/null 2>&1 &
    local pr=$!
    wait "$c"
    kill -INT "$pr" 2>/dev/null
    wait "$pr" 2>/dev/null
    wait "$s"
    perf script -i "$OUT/why.data" -F comm,pid,tid,event,ip,sym >"$OUT/why.txt" 2>/dev/null
    rm -f "$OUT/why.data"
    python3 - "$sp" "$OUT/why.txt" <<'PY'
import collections, sys
srv = sys.argv[1]
count, names, side = collections.Counter(), {}, {}
for ev in open(sys.argv[2]).read().split('\n\n'):
    lines = ev.strip().split('\n')
    if not lines or not lines[0].strip():
        continue
    head = lines[0].split()
    comm, pid_tid = head[0], head[1]
    pid, _, tid = pid_tid.partition('/')
    names[tid], side[tid] = comm, 'server' if pid == srv else 'client'
    if 'sys_enter_sendmsg' in lines[0] or 'sys_enter_sendto' in lines[0]:
        count[(tid, 'socket writes')] += 1
        continue
    frames = [l.split(None, 1)[-1] for l in lines[1:]]
    body = ' '.join(frames)
    if 'futex_wait' in body:
        why = 'asleep: futex'
    elif 'do_sys_poll' in body:
        why = 'asleep: poll'
    elif 'do_epoll_wait' in body:
        why = 'asleep: epoll_wait'
    elif 'exit_to_user_mode' in body:
        why = 'preempted'
        for i, f in enumerate(frames):
            if 'entry_SYSCALL' in f and i + 1 < len(frames):
                why = 'preempted after ' + frames[i + 1].split()[0]
                break
    else:
        why = 'other'
    count[(tid, why)] += 1
n = sum(v for (t, k), v in count.items() if k == 'socket writes' and side[t] == 'server') / 4
if n < 1:
    sys.exit('  (no iteration seen)')
print(f'  {n:.0f} iterations seen')
for (t, k), v in sorted(count.items(), key=lambda kv: (side[kv[0][0]], kv[0])):
    if k != 'socket writes' and v / n >= 0.02:
        print(f'  {side[t]} {names[t]}-{t:<8} {k:<36} {v / n:.2f}')
PY
    rm -f "$OUT/why.txt"
}

declare -A R
F=()
for r in $(seq "$ROUNDS"); do
    F+=("$(floor_rtt)")
    order=("${!BUILDS[@]}")
    ((r % 2 == 0)) && order=($(printf '%s\n' "${order[@]}" | tac))
    line="round $r: floor RTT ${F[-1]} us"
    for i in "${order[@]}"; do
        v=$(rping_run "${BUILDS[$i]}")
        R[$i]+="$v;"
        line+=" | ${BUILDS[$i]}: $v"
    done
    echo "$line (load $(cut -d' ' -f1 /proc/loadavg))"
done
for i in "${!BUILDS[@]}"; do
    python3 - "${BUILDS[$i]}" "${R[$i]}" "${F[*]}" <<'PY'
import statistics as st, sys
rows = [list(map(float, r.split())) for r in sys.argv[2].split(';') if r and 'nan' not in r]
floor = st.median(map(float, sys.argv[3].split()))
if not rows:
    sys.exit(f"{sys.argv[1]}: every run failed")
us, cpu, cs = (st.median(c) for c in zip(*rows))
print(f"{sys.argv[1]}: {len(rows)} runs, per iteration {us:.1f} us ({us / floor:.1f}x the {floor:.1f} us round trip), cpu {cpu:.1f} us, {cs:.2f} switches")
PY
done
for b in "${BUILDS[@]}"; do
    echo "per thread, per iteration ($b):"
    threads "$b"
    echo "why each thread left the CPU, per iteration ($b):"
    why "$b"
done
