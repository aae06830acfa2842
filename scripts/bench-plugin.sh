#!/usr/bin/env bash
# What the rdma-core plugin costs: perftest (`ib_write_lat`, `ib_read_lat`,
# `ib_atomic_lat`, each -R, unmodified, through `stag run`) against
# `stag lat` for the same operation, both as a server and a client process
# on 127.0.0.1, busy-polling, in alternating rounds; typical latency
# (perftest's t_typical, stag's t_typical_us), medians, ratio
# plugin / stag lat. Writes target/bench-plugin.{md,json}.
#
#   scripts/bench-plugin.sh [ROUNDS] [ITERS]     (defaults 5, 20000)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${1:-5}
ITERS=${2:-20000}
cargo build --release --quiet -p stag -p stag-rdma
STAG=$PWD/target/release/stag
port=23000

source scripts/lib.sh

# stag_lat OP: t_typical_us of one two-process run.
stag_lat() {
    port=$((port + 1))
    "$STAG" lat "$1" -p "$port" -n "$ITERS" --bind 127.0.0.1 >/dev/null 2>&1 &
    local s=$!
    wait_port "$port"
    "$STAG" lat "$1" 127.0.0.1 -p "$port" -n "$ITERS" --json 2>/dev/null |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["results"][0]["t_typical_us"])'
    wait "$s"
}

# perftest PROG: t_typical of one two-process run (8-byte messages).
perftest() {
    port=$((port + 1))
    "$STAG" run -- "$1" -R -d stag0 -p "$port" -n "$ITERS" -s 8 >/dev/null 2>&1 &
    local s=$!
    wait_port "$port"
    "$STAG" run -- "$1" -R -d stag0 -p "$port" -n "$ITERS" -s 8 127.0.0.1 2>/dev/null |
        awk '$1 == 8 && NF >= 5 { print $5 }'
    wait "$s"
}

declare -A S P
ops=(write read fetch-add send)
progs=(ib_write_lat ib_read_lat ib_atomic_lat ib_send_lat)
for ((r = 1; r <= ROUNDS; r++)); do
    for i in "${!ops[@]}"; do
        S[$i]+="$(stag_lat "${ops[$i]}") "
        P[$i]+="$(perftest "${progs[$i]}") "
    done
    echo "round $r done" >&2
done

python3 - "$ROUNDS" "$ITERS" "${ops[@]}" -- "${progs[@]}" -- "${S[0]}" "${S[1]}" "${S[2]}" "${S[3]}" -- "${P[0]}" "${P[1]}" "${P[2]}" "${P[3]}" <<'PY'
import json, statistics, sys
a = sys.argv[1:]
rounds, iters = a[0], a[1]
rest = a[2:]
i = rest.index("--"); ops = rest[:i]; rest = rest[i+1:]
i = rest.index("--"); progs = rest[:i]; rest = rest[i+1:]
i = rest.index("--"); s = [list(map(float, x.split())) for x in rest[:i]]
p = [list(map(float, x.split())) for x in rest[i+1:]]
rows = []
md = ["| operation | `stag lat` typical µs (median) | perftest via plugin typical µs (median) | ratio | target |",
      "|---|---:|---:|---:|---:|"]
for op, prog, sv, pv in zip(ops, progs, s, p):
    ms, mp = statistics.median(sv), statistics.median(pv)
    rows.append({"op": op, "perftest": prog, "stag_lat_us": sv, "perftest_us": pv,
                 "stag_lat_median_us": ms, "perftest_median_us": mp, "ratio": mp / ms})
    md.append(f"| {op} (`{prog} -R`) | {ms:.2f} | {mp:.2f} | {mp/ms:.2f} | ≤ 1.10 |")
md.append(f"\n{rounds} alternating rounds, {iters} iterations each, 8 bytes, two processes on 127.0.0.1, busy polling.")
open("target/bench-plugin.md", "w").write("\n".join(md) + "\n")
json.dump({"rounds": int(rounds), "iterations": int(iters), "results": rows}, open("target/bench-plugin.json", "w"), indent=2)
print("\n".join(md))
PY
