#!/usr/bin/env bash
# How long stag's userspace holds one message up (issue #20's per-message
# cost): the client's turnaround in a busy ping-pong, from the moment the
# kernel hands it the peer's bytes (`recvfrom` returns data) to the moment
# it asks the kernel to send the next message (`sendto` is entered), beside
# the same turnaround of the TCP floor (`stag floor lat --mode busy`) in the
# same round. Everything between those two points is userspace: for stag,
# deframing and placing the FPDU, the completion's way up through the
# provider's CQ and the verbs layer, the program's turn, and the post's way
# down to the socket; for the floor, its loop. The kernel's share (the two
# system calls and loopback) is the same on both sides and is not in it.
#
# The turnaround is read from system-call tracepoints (perf record of
# sys_exit_recvfrom and sys_enter_sendto on the client), so no build of
# stag is instrumented; the tracepoints add the same fixed cost to both
# sides (most of the floor's 0.9 us here), and the difference
# `stag - floor` is what stag adds per message it answers. Unlike the
# latency, the turnaround does not move with the scheduler's placement of
# the two processes or with loopback; it still moves with the machine's
# speed, so each round measures every op and the floor back to back and
# the medians are taken over rounds.
#
#   scripts/bench/turnaround.sh [ROUNDS]      (default 5)
#     STAG_BIN=path/to/stag   the build to measure (default target/release/stag,
#                             built first)
#     BASE_BIN=path/to/stag   a second build, measured in every round right
#                             after the first (its rows end in "@base")
#     OPS="write send read fetch-add"   the stag lat ops (8 octets, busy)
#     JSON=FILE               also write the medians as JSON
#     KEEP=1                  keep the last trace and every run's row (the
#                             directory is printed)
#     SYMBOLS=N               also sample the client's userspace (cpu-clock,
#                             every 3 us of CPU: the VM has no cycle counter)
#                             and print, per build and op, the N symbols that
#                             take the most samples inside the turnaround,
#                             and the samples per 1000 turnarounds (a relative
#                             size: the sampling itself slows the client, so
#                             take the turnarounds from a run without it)
#
# Not in the test gate (timings). Needs perf (linux-perf, scripts/setup.sh)
# and root; uses ports 21000-21999, so run it in a network namespace of your
# own when others test on the machine:
#   ip netns exec NAME bash scripts/bench/turnaround.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-5}
OPS=${OPS:-write send read fetch-add}
if [[ -z ${STAG_BIN:-} ]]; then
    cargo build --release --quiet -p stag || exit 1
fi
BIN=${STAG_BIN:-$PWD/target/release/stag}
BUILDS=("$BIN")
[[ -n ${BASE_BIN:-} ]] && BUILDS+=("$BASE_BIN")
command -v perf >/dev/null || {
    echo "turnaround: perf is missing (scripts/setup.sh installs linux-perf)" >&2
    exit 1
}
source scripts/lib/common.sh
OUT=$(mktemp -d); [[ -n ${KEEP:-} ]] && echo "turnaround: $OUT" >&2
[[ -n ${KEEP:-} ]] || trap 'rm -rf "$OUT"' EXIT
ITERS=400000

# From the client's trace: per thread, each recvfrom that returned data
# paired with the sendto that follows it; the thread that sends the most
# runs the ping-pong.
PAIRS=$(cat <<'PY'
import json, re, statistics, sys
name, report = sys.argv[1], sys.argv[2]
# Per thread: the last recvfrom that returned data, and its time.
got = {}
gaps = {}
pat = re.compile(r"^\s*(\d+)\s+(\d+\.\d+):\s+syscalls:(sys_exit_recvfrom|sys_enter_sendto):\s*(\S*)")
for line in sys.stdin:
    m = pat.match(line)
    if not m:
        continue
    tid, t, event = int(m[1]), float(m[2]), m[3]
    if event == "sys_exit_recvfrom":
        ret = int(m[4], 16) if m[4].startswith("0x") else int(m[4])
        if 0 < ret < 1 << 62:
            got[tid] = t
    elif tid in got:
        gaps.setdefault(tid, []).append(t - got.pop(tid))
# The thread that runs the ping-pong sends the most.
if not gaps:
    print(f"{name} nan 0 nan")
    sys.exit()
g = max(gaps.values(), key=len)
r = json.load(open(report))["results"][0]
print(f"{name} {statistics.median(g) * 1e9:.0f} {len(g)} {r['t_typical_us']}")
PY
)

# From the same trace with SYMBOLS: the client's userspace samples that
# fall inside the ping-pong thread's turnarounds, by symbol, as one JSON
# line "name, turnarounds, {symbol: samples}".
SYMS=$(cat <<'PY'
import collections, json, re, sys
name = sys.argv[1]
open_at = {}
windows = collections.Counter()
samples = collections.defaultdict(collections.Counter)
pat = re.compile(r"^\s*(\d+)\s+[\d.]+:\s+(\S+):\s*(.*)$")
for line in sys.stdin:
    m = pat.match(line)
    if not m:
        continue
    tid, event, rest = int(m[1]), m[2], m[3].strip()
    if event == "syscalls:sys_exit_recvfrom":
        # The return value, then the sample's ip and symbol.
        ret = rest.split()[0]
        ret = int(ret, 16) if ret.startswith("0x") else int(ret)
        if 0 < ret < 1 << 62:
            open_at[tid] = True
            windows[tid] += 1
    elif event == "syscalls:sys_enter_sendto":
        open_at[tid] = False
    elif event.startswith("cpu-clock") and open_at.get(tid):
        sym = re.sub(r"^[0-9a-f]+\s+", "", rest)
        sym = re.sub(r"\+0x[0-9a-f]+$", "", sym.split(" (")[0]) or "?"
        samples[tid][sym] += 1
if windows:
    tid = max(windows, key=windows.get)
    print(json.dumps([name, windows[tid], samples[tid]]))
PY
)

# turnaround NAME SERVER_CMD... -- CLIENT_CMD...: run the pair, trace the
# client for a second once it is past its warm-up, append "NAME ns count
# one_way_us" to $OUT/rows.
turnaround() {
    local name=$1 port=$((21000 + RANDOM % 1000))
    shift
    local args=("$@") i
    for ((i = 0; i < ${#args[@]}; i++)); do
        [[ ${args[i]} == -- ]] && break
    done
    local server=("${args[@]:0:i}") client=("${args[@]:i+1}")
    "${server[@]}" -p "$port" >/dev/null 2>&1 &
    local spid=$!
    wait_port "$port" || echo "turnaround: $name: the server never listened" >&2
    "${client[@]}" -p "$port" --json 127.0.0.1 >"$OUT/client.json" 2>/dev/null &
    local cpid=$!
    sleep 1
    local sample=()
    [[ -n ${SYMBOLS:-} ]] && sample=(-e cpu-clock:u -c 3000)
    perf record -q -e syscalls:sys_exit_recvfrom,syscalls:sys_enter_sendto "${sample[@]}" \
        -p "$cpid" -o "$OUT/trace.data" -- sleep 1 >/dev/null 2>&1
    wait "$cpid" "$spid"
    perf script --ns -F tid,time,event,trace -i "$OUT/trace.data" 2>/dev/null |
        python3 -c "$PAIRS" "$name" "$OUT/client.json" >>"$OUT/rows"
    if [[ -n ${SYMBOLS:-} ]]; then
        perf script --ns -F tid,time,event,trace,ip,sym -i "$OUT/trace.data" 2>/dev/null |
            python3 -c "$SYMS" "$name" >>"$OUT/symbols"
    fi
}

for ((round = 1; round <= ROUNDS; round++)); do
    turnaround floor "$BIN" floor lat --mode busy -n "$ITERS" -- \
        "$BIN" floor lat --mode busy -n "$ITERS"
    for op in $OPS; do
        for b in "${BUILDS[@]}"; do
            name=$op
            [[ $b != "$BIN" ]] && name=$op@base
            turnaround "$name" "$b" lat "$op" -s 8 -n "$ITERS" --progress busy -- \
                "$b" lat "$op" -s 8 -n "$ITERS" --progress busy
        done
    done
    echo "round $round: $(grep -c . "$OUT/rows") runs" >&2
done

NAMES=()
for op in $OPS; do
    NAMES+=("$op")
    [[ -n ${BASE_BIN:-} ]] && NAMES+=("$op@base")
done
python3 - "$OUT/rows" "${JSON:-}" "${NAMES[@]}" <<'PY'
import json, statistics, sys
rows, json_out, ops = sys.argv[1], sys.argv[2], sys.argv[3:]
runs = {}
for line in open(rows):
    name, ns, n, one_way = line.split()
    if ns != "nan":
        runs.setdefault(name, []).append((float(ns), int(n), float(one_way)))
def med(name, k):
    return statistics.median(r[k] for r in runs[name]) if name in runs else float("nan")
floor = med("floor", 0)
print("Userspace turnaround per message (busy, 8 octets): median over rounds")
print("(t_typical: one-way for write and send, the round trip for read and the atomics)")
print(f"{'':14} {'turnaround ns':>14} {'stag - floor':>13} {'samples/run':>12} {'t_typical us (traced)':>22}")
out = {"floor_ns": floor, "ops": {}}
for name in ["floor"] + ops:
    t = med(name, 0)
    extra = "" if name == "floor" else f"{t - floor:13.0f}"
    print(f"{name:14} {t:14.0f} {extra:>13} {med(name, 1):12.0f} {med(name, 2):22.2f}")
    if name != "floor":
        out["ops"][name] = {"turnaround_ns": t, "over_floor_ns": t - floor,
                            "rounds": [r[0] for r in runs.get(name, [])]}
if json_out:
    json.dump(out, open(json_out, "w"), indent=1)
PY
if [[ -n ${SYMBOLS:-} && -s $OUT/symbols ]]; then
    python3 - "$OUT/symbols" "$SYMBOLS" <<'PY'
import collections, json, sys
windows = collections.Counter()
samples = collections.defaultdict(collections.Counter)
for line in open(sys.argv[1]):
    name, n, syms = json.loads(line)
    windows[name] += n
    samples[name].update(syms)
top = int(sys.argv[2])
print()
print("Userspace samples inside the turnaround (cpu-clock every 3 us of CPU, all rounds)")
for name in windows:
    total = sum(samples[name].values())
    print(f"{name}: {1000 * total / windows[name]:.0f} samples per 1000 turnarounds")
    for sym, n in samples[name].most_common(top):
        print(f"  {100 * n / max(total, 1):5.1f}%  {sym[:100]}")
PY
fi
