#!/usr/bin/env bash
# What the rdma-core plugin costs: perftest (`ib_write_lat`, `ib_read_lat`,
# `ib_atomic_lat`, `ib_send_lat`, each -R, unmodified, through `stag run`)
# against `stag lat` for the same operation, like for like: two processes
# on 127.0.0.1, 8-byte messages, the same iteration count, the same
# progress mode ($STAG_PROGRESS, default adaptive, for every program),
# MPA CRC on for both (perftest's rdma_cm and `stag lat` both ask for it),
# the median (perftest's t_typical, stag's t_typical_us) of each run, and
# the median of those over ROUNDS alternating rounds.
#
# Write latency depends on how the program waits: ib_write_lat spins on
# the last byte of its buffer and enters the provider only to post and to
# reap its own Write, while `stag lat write` polls its CQ as it spins and
# places the peer's Write itself. On the bare RNIC the first needs the
# progress engine to place every Write (a thread wake-up per message when
# the cores are taken); through the plugin the receive assist (README,
# "Latency through the plugin") has the reaping thread place it. So write
# has two more rows from a Rust program on the RNIC directly, no plugin
# (provider/plugin/examples/write_lat_raw.rs): perftest's method (memory
# only) and stag's (`--drive`, memory + CQ polling).
#
# Writes target/bench-plugin.{md,json}.
#
#   scripts/bench/bench-plugin.sh [ROUNDS] [ITERS]     (defaults 5, 20000)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${1:-5}
ITERS=${2:-20000}
cargo build --release --quiet -p stag -p stag-rdma
cargo build --release --quiet -p stag-rdma --example write_lat_raw
STAG=$PWD/target/release/stag
RAW=$PWD/target/release/examples/write_lat_raw
port=23000

source scripts/lib/common.sh

# Each run gets a port of its own (a server of the previous run may still
# be listening on the last one). The runners below are called in command
# substitutions, which cannot advance `port` for the caller: `measure`
# advances it and passes it on. A run that hangs is killed after LIMIT
# seconds and counts as missing (its cell says so).
LIMIT=${LIMIT:-120}

# measure KEY RUNNER ARGS...: append RUNNER's figure to V[KEY].
measure() {
    local key=$1
    shift
    port=$((port + 1))
    local x
    x=$("$@" "$port") || true
    [[ $x =~ ^[0-9.]+$ ]] || { echo "$key: no result (port $port)" >&2; x=nan; }
    V[$key]+="$x "
}

# stag_lat OP PORT: t_typical_us of one two-process run.
stag_lat() {
    timeout "$LIMIT" "$STAG" lat "$1" -s 8 -p "$2" -n "$ITERS" --bind 127.0.0.1 >/dev/null 2>&1 &
    local s=$!
    wait_port "$2"
    timeout "$LIMIT" "$STAG" lat "$1" -s 8 127.0.0.1 -p "$2" -n "$ITERS" --json 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["results"][0]["t_typical_us"])'
    wait "$s"
}

# raw [--drive] PORT: median half round trip of write_lat_raw.
raw() {
    local port=${*: -1} flags=("${@:1:$#-1}")
    timeout "$LIMIT" "$RAW" server "$port" "$ITERS" "${flags[@]}" >/dev/null 2>&1 &
    local s=$!
    wait_port "$port"
    timeout "$LIMIT" "$RAW" client "127.0.0.1:$port" "$ITERS" "${flags[@]}" 2>/dev/null |
        awk '{ print $2 }'
    wait "$s"
}

# perftest PROG PORT: t_typical of one two-process run (8-byte messages).
perftest() {
    timeout "$LIMIT" "$STAG" run -- "$1" -R -d stag0 -p "$2" -n "$ITERS" -s 8 >/dev/null 2>&1 &
    local s=$!
    wait_port "$2"
    timeout "$LIMIT" "$STAG" run -- "$1" -R -d stag0 -p "$2" -n "$ITERS" -s 8 127.0.0.1 2>/dev/null |
        awk '$1 == 8 && NF >= 5 { print $5 }'
    wait "$s"
}

# One column per program, in the order the rows use them.
declare -A V
load_start=$(cut -d' ' -f1-4 /proc/loadavg)
for ((r = 1; r <= ROUNDS; r++)); do
    measure write.stag stag_lat write
    measure write.raw_drive raw --drive
    measure write.raw_memory raw
    measure write.perftest perftest ib_write_lat
    measure read.stag stag_lat read
    measure read.perftest perftest ib_read_lat
    measure fetch-add.stag stag_lat fetch-add
    measure fetch-add.perftest perftest ib_atomic_lat
    measure send.stag stag_lat send
    measure send.perftest perftest ib_send_lat
    echo "round $r done" >&2
done
load_end=$(cut -d' ' -f1-4 /proc/loadavg)

args=()
for k in "${!V[@]}"; do args+=("$k=${V[$k]}"); done
python3 - "$ROUNDS" "$ITERS" "${STAG_PROGRESS:-adaptive}" "$load_start" "$load_end" "${args[@]}" <<'PY'
import json, statistics, sys
rounds, iters, progress, load_start, load_end = sys.argv[1:6]
v = {}
for a in sys.argv[6:]:
    k, _, xs = a.partition("=")
    v[k] = [float(x) for x in xs.split() if x != "nan"]
missing = {k: int(rounds) - len(x) for k, x in v.items() if len(x) < int(rounds)}
med = {k: statistics.median(x) if x else float("nan") for k, x in v.items()}

def cell(k):
    x = v[k]
    if not x:
        return "no result"
    miss = f", {missing[k]} missing" if k in missing else ""
    return f"{med[k]:.2f} ({min(x):.2f}–{max(x):.2f}{miss})"

rows = [
    ("write", "ib_write_lat -R", "write.raw_memory"),
    ("read", "ib_read_lat -R", "read.stag"),
    ("fetch-add", "ib_atomic_lat -R", "fetch-add.stag"),
    ("send", "ib_send_lat -R", "send.stag"),
]
md = [
    "| operation | `stag lat` µs | same method, no plugin µs | perftest via plugin µs | plugin / `stag lat` | plugin / same method | target |",
    "|---|---:|---:|---:|---:|---:|---:|",
]
out = []
for op, prog, same in rows:
    s, p, m = med[f"{op}.stag"], med[f"{op}.perftest"], med[same]
    same_cell = cell(same) if same != f"{op}.stag" else "= `stag lat`"
    md.append(f"| {op} (`{prog}`) | {cell(op + '.stag')} | {same_cell} | {cell(op + '.perftest')} "
              f"| {p / s:.2f} | {p / m:.2f} | ≤ 1.10 |")
    out.append({"op": op, "perftest": prog, "same_method": same,
                "stag_lat_us": v[f"{op}.stag"], "perftest_us": v[f"{op}.perftest"],
                "same_method_us": v[same],
                "stag_lat_median_us": s, "perftest_median_us": p, "same_method_median_us": m,
                "ratio": p / s, "ratio_same_method": p / m})
md.append(f"| write, `write_lat_raw --drive` (stag's method, no plugin) | | {cell('write.raw_drive')} | | | | |")
md.append("")
md.append(f"Median of {rounds} alternating rounds (min–max of the rounds in brackets), each "
          f"round one two-process run per program on 127.0.0.1: {iters} iterations, 8 bytes, "
          f"progress mode {progress} for every program, MPA CRC on, each run's median "
          f"(perftest t_typical, stag t_typical_us). Read and fetch-add are one round trip, "
          f"write and send half of one. Load average (1/5/15 min, running/threads) "
          f"{load_start} before, {load_end} after.")
md.append("")
md.append("\"Same method\" for write is `write_lat_raw` (provider/plugin/examples), which waits "
          "as ib_write_lat does: it spins on memory and enters the provider only to post and to "
          "reap its own Write, so on the bare RNIC the progress engine must place every Write; "
          "through the plugin, the receive assist has the reaping thread place it. "
          "`stag lat write` polls its CQ while it spins and places the Write from the spinning "
          "thread (`write_lat_raw --drive` does the same without `stag lat`'s framework).")
open("target/bench-plugin.md", "w").write("\n".join(md) + "\n")
json.dump({"rounds": int(rounds), "iterations": int(iters), "progress": progress,
           "loadavg_before": load_start, "loadavg_after": load_end,
           "write_raw_drive_us": v["write.raw_drive"], "results": out},
          open("target/bench-plugin.json", "w"), indent=2)
print("\n".join(md))
PY
