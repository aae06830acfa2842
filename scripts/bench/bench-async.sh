#!/usr/bin/env bash
# The async API against the blocking one and against TCP, every figure from
# two processes (server in the background, client in the foreground),
# ROUNDS rounds each running every pair once in a fixed order, medians
# over the rounds:
#
#   - async ping-pong (examples/async_bench.rs, current-thread runtime):
#     8-byte send and write-imm (half round trip), fetch-add (full round
#     trip of one Op future), against `stag lat` for the same op, busy
#     polling and --blocking (event-driven, as the runtime is); and the
#     same with the CQ spinning SPIN_US before it sleeps, against busy;
#   - RdmaStream, 1 MiB writes (its defaults; no CQ spin; Sends), against
#     `stag bw write -s 1048576` and a tokio TcpStream; and the same MiB
#     through its zero-copy slot path (`rdma-stream-slots`: send_slot /
#     recv_slot, no payload copy on either side); with SLOT_SHAPES (e.g.
#     "8x128 4x256": slots x KiB per slot), both stream rows again at each
#     shape, in the same rounds;
#   - tonic unary RPC latency (examples/grpc_echo.rs, GRPC_CALLS calls)
#     over RdmaStream (CQ spin none; SPIN_US; SPIN_US with Sends)
#     against tonic over TCP.
#
#   scripts/bench/bench-async.sh   (ROUNDS=3 ITERS=5000 MIB=512 SPIN_US=1000 OUT=target/bench-async
#                                   PARTS="lat stream grpc": which groups run; SLOT_SHAPES="")
set -euo pipefail
cd "$(dirname "$0")/../.."

ROUNDS=${ROUNDS:-3}
ITERS=${ITERS:-5000}
MIB=${MIB:-512}
# The spin of the async CQ in the "spin" rows (AsyncCompletionQueue::with_spin;
# its docs say why 1 ms on stag0).
SPIN_US=${SPIN_US:-1000}
GRPC_CALLS=${GRPC_CALLS:-2000}
BW_ITERS=${BW_ITERS:-$MIB}
OUT=${OUT:-target/bench-async}
PARTS=${PARTS:-lat stream grpc}
SLOT_SHAPES=${SLOT_SHAPES:-}
want() { [[ " $PARTS " == *" $1 "* ]]; }
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.server.log

cargo build --release --quiet -p stag --features grpc --bins --examples
STAG=target/release/stag
BENCH=target/release/examples/async_bench
GRPC=target/release/examples/grpc_echo
port=$((20000 + RANDOM % 20000))

# wait_listen PID: until the server listens on $port (a fixed sleep lost the
# race under load: "Connection refused"), or it died, or 20 s passed.
wait_listen() {
    local i
    for i in $(seq 200); do
        ss -Hltn "sport = :$port" | grep -q . && return 0
        kill -0 "$1" 2>/dev/null || return 0
        sleep 0.1
    done
}

# pair NAME SERVER_CMD... -- CLIENT_CMD...: one measurement, the client's
# JSON appended to $OUT/NAME.json.
pair() {
    local name=$1
    shift
    local server=() client=()
    while [[ $1 != -- ]]; do server+=("$1"); shift; done
    shift
    client=("$@")
    "${server[@]}" >"$OUT/server.log" 2>&1 &
    local spid=$!
    wait_listen "$spid"
    if ! timeout 300 "${client[@]}" >"$OUT/client.out" 2>"$OUT/client.log"; then
        echo "bench-async: $name failed:" >&2
        cat "$OUT/client.log" "$OUT/server.log" >&2
        kill "$spid" 2>/dev/null || true
        exit 1
    fi
    wait "$spid" || true
    # The server's log, kept per pair (slow_yields of the stream sink).
    { echo "== round $round"; cat "$OUT/server.log"; } >>"$OUT/$name.server.log"
    # Each round's client JSON, with the 1-minute load average at its end.
    python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); d["load"]=float(open("/proc/loadavg").read().split()[0]); print(json.dumps(d))' \
        <"$OUT/client.out" >>"$OUT/$name.json"
    port=$((port + 7))
}

# serve NAME SERVER_CMD... -- CLIENT_CMD...: as pair, for a server that
# runs until killed (the gRPC servers).
serve() {
    local name=$1
    shift
    local server=() client=()
    while [[ $1 != -- ]]; do server+=("$1"); shift; done
    shift
    client=("$@")
    "${server[@]}" >"$OUT/server.log" 2>&1 &
    local spid=$!
    wait_listen "$spid"
    local rc=0
    timeout 300 "${client[@]}" >"$OUT/client.out" 2>"$OUT/client.log" || rc=$?
    kill "$spid" 2>/dev/null || true
    wait "$spid" 2>/dev/null || true
    if ((rc != 0)); then
        echo "bench-async: $name failed:" >&2
        cat "$OUT/client.log" "$OUT/server.log" >&2
        exit 1
    fi
    cat "$OUT/client.out" >>"$OUT/$name.json"
    port=$((port + 7))
}

for round in $(seq "$ROUNDS"); do
    echo "== round $round/$ROUNDS ($(uptime | sed 's/.*load/load/'))" >&2
    want lat && for op in send write-imm fetch-add; do
        size=(-s 8)
        [[ $op == fetch-add ]] && size=()
        pair "stag-lat-$op-busy" $STAG lat "$op" "${size[@]}" -n "$ITERS" -p $port --json -- \
            $STAG lat "$op" "${size[@]}" -n "$ITERS" -p $port --json 127.0.0.1
        pair "stag-lat-$op-blocking" $STAG lat "$op" "${size[@]}" -n "$ITERS" -p $port --json --blocking -- \
            $STAG lat "$op" "${size[@]}" -n "$ITERS" -p $port --json --blocking 127.0.0.1
        pair "async-lat-$op" $BENCH server lat "$op" $port -- \
            $BENCH client lat "$op" 127.0.0.1:$port "$ITERS"
        pair "async-lat-$op-spin" env ASYNC_BENCH_SPIN_US=$SPIN_US $BENCH server lat "$op" $port -- \
            env ASYNC_BENCH_SPIN_US=$SPIN_US $BENCH client lat "$op" 127.0.0.1:$port "$ITERS"
    done
    if want stream; then
    pair stag-bw-write $STAG bw write -s 1048576 -n "$BW_ITERS" -p $port --json -- \
        $STAG bw write -s 1048576 -n "$BW_ITERS" -p $port --json 127.0.0.1
    pair rdma-stream $BENCH server stream $port -- $BENCH client stream 127.0.0.1:$port "$MIB"
    pair rdma-stream-slots $BENCH server stream-slots $port -- \
        $BENCH client stream-slots 127.0.0.1:$port "$MIB"
    for shape in $SLOT_SHAPES; do
        geo=(env ASYNC_BENCH_SLOTS=${shape%x*} ASYNC_BENCH_SLOT_KIB=${shape#*x})
        pair "rdma-stream-$shape" "${geo[@]}" $BENCH server stream $port -- \
            "${geo[@]}" $BENCH client stream 127.0.0.1:$port "$MIB"
        pair "rdma-stream-slots-$shape" "${geo[@]}" $BENCH server stream-slots $port -- \
            "${geo[@]}" $BENCH client stream-slots 127.0.0.1:$port "$MIB"
    done
    pair rdma-stream-nospin env ASYNC_BENCH_SPIN_US=0 $BENCH server stream $port -- \
        env ASYNC_BENCH_SPIN_US=0 $BENCH client stream 127.0.0.1:$port "$MIB"
    pair rdma-stream-sends env ASYNC_BENCH_SENDS=1 $BENCH server stream $port -- \
        env ASYNC_BENCH_SENDS=1 $BENCH client stream 127.0.0.1:$port "$MIB"
    pair tcp-stream $BENCH server tcp $port -- $BENCH client tcp 127.0.0.1:$port "$MIB"
    fi
    want grpc && for t in rdma tcp; do
        serve "grpc-unary-$t" env GRPC_SPIN_US=0 $GRPC server $t $port -- \
            env GRPC_SPIN_US=0 $GRPC client $t 127.0.0.1:$port "$GRPC_CALLS"
    done
    want grpc || continue
    serve grpc-unary-rdma-spin env GRPC_SPIN_US=$SPIN_US $GRPC server rdma $port -- \
        env GRPC_SPIN_US=$SPIN_US $GRPC client rdma 127.0.0.1:$port "$GRPC_CALLS"
    serve grpc-unary-rdma-spin-sends env GRPC_SENDS=1 GRPC_SPIN_US=$SPIN_US $GRPC server rdma $port -- \
        env GRPC_SENDS=1 GRPC_SPIN_US=$SPIN_US $GRPC client rdma 127.0.0.1:$port "$GRPC_CALLS"
done

python3 - "$OUT" <<'PY'
import json, statistics, sys, pathlib
out = pathlib.Path(sys.argv[1])
def runs(name):
    return [json.loads(l) for l in (out / f"{name}.json").read_text().splitlines()]
def lat(name):
    vals = []
    for d in runs(name):
        r = d["results"][0] if "results" in d else d
        vals.append(r["t_typical_us"])
    return statistics.median(vals)
def bw(name):
    vals = []
    for d in runs(name):
        r = d["results"][0] if "results" in d else d
        vals.append(r["bw_avg_mb_s"])
    return statistics.median(vals)
def have(name):
    return (out / f"{name}.json").exists()
def tail(name):
    # p10/p90/p99 of the median round, when the client reports them.
    d = sorted(runs(name), key=lambda d: d["t_typical_us"])[len(runs(name)) // 2]
    return " ".join(f"{k[:-3]} {d[k]:.0f}" for k in ("p10_us", "p90_us", "p99_us") if k in d)
rows = ["| measurement | async | against | ratio | target |", "|---|---|---|---|---|"]
report = {}
for op in ["send", "write-imm", "fetch-add"]:
    if not have(f"async-lat-{op}"):
        continue
    a = lat(f"async-lat-{op}")
    for mode in ["busy", "blocking"]:
        s = lat(f"stag-lat-{op}-{mode}")
        rows.append(f"| {op} 8 B latency (µs, median) | {a:.2f} | stag lat {mode} {s:.2f} | {a/s:.2f}× | ≤ 1.2× |")
        report[f"lat-{op}-{mode}"] = {"async_us": a, "stag_us": s, "ratio": a / s}
    a = lat(f"async-lat-{op}-spin")
    s = lat(f"stag-lat-{op}-busy")
    rows.append(f"| {op} 8 B latency, CQ spin (µs, median) | {a:.2f} | stag lat busy {s:.2f} | {a/s:.2f}× | ≤ 1.2× |")
    report[f"lat-{op}-spin"] = {"async_us": a, "stag_us": s, "ratio": a / s}
if have("rdma-stream"):
    st, sb, tc = bw("rdma-stream"), bw("stag-bw-write"), bw("tcp-stream")
    rows.append(f"| RdmaStream 1 MiB (MB/s) | {st:.0f} | stag bw write {sb:.0f} | {st/sb:.2f}× | ≥ 0.8× |")
    rows.append(f"| RdmaStream 1 MiB (MB/s) | {st:.0f} | tokio TcpStream {tc:.0f} | {st/tc:.2f}× | ≥ 0.8× |")
    sn = bw("rdma-stream-nospin")
    rows.append(f"| RdmaStream 1 MiB, CQ spin 0 (MB/s) | {sn:.0f} | tokio TcpStream {tc:.0f} | {sn/tc:.2f}× | (compare) |")
    ss = bw("rdma-stream-sends")
    rows.append(f"| RdmaStream 1 MiB, Sends (MB/s) | {ss:.0f} | tokio TcpStream {tc:.0f} | {ss/tc:.2f}× | (compare) |")
    sl = bw("rdma-stream-slots")
    rows.append(f"| RdmaStream 1 MiB, slot path (MB/s) | {sl:.0f} | stag bw write {sb:.0f} | {sl/sb:.2f}× | ≥ 0.8× |")
    rows.append(f"| RdmaStream 1 MiB, slot path (MB/s) | {sl:.0f} | tokio TcpStream {tc:.0f} | {sl/tc:.2f}× | ≥ 0.8× |")
    shapes = sorted(p.stem[len("rdma-stream-slots-"):] for p in out.glob("rdma-stream-slots-*.json"))
    for shape in shapes:
        a, b = bw(f"rdma-stream-{shape}"), bw(f"rdma-stream-slots-{shape}")
        rows.append(f"| RdmaStream 1 MiB, {shape} KiB slots: traits / slot path (MB/s) | {a:.0f} / {b:.0f} | stag bw write {sb:.0f} | {a/sb:.2f}× / {b/sb:.2f}× | (compare) |")
        report[f"stream-{shape}"] = {"rdma_stream_mb_s": a, "rdma_stream_slots_mb_s": b}
    report["stream"] = {"rdma_stream_mb_s": st, "rdma_stream_slots_mb_s": sl, "rdma_stream_nospin_mb_s": sn,
                        "rdma_stream_sends_mb_s": ss, "stag_bw_write_mb_s": sb, "tcp_mb_s": tc,
                        "rounds": {n: [(r["results"][0] if "results" in r else r)["bw_avg_mb_s"]
                                       for r in runs(n)]
                                   for n in ["rdma-stream", "rdma-stream-slots", "stag-bw-write",
                                             "tcp-stream"]}}
if have("grpc-unary-rdma"):
    gt = lat("grpc-unary-tcp")
    for name, what in [("grpc-unary-rdma", "CQ spin 0"), ("grpc-unary-rdma-spin", "stream CQ spin"),
                       ("grpc-unary-rdma-spin-sends", "stream CQ spin, Sends")]:
        g = lat(name)
        rows.append(f"| tonic unary RPC latency, {what} (µs, median; {tail(name)}) | {g:.1f} | tonic over TCP {gt:.1f} ({tail('grpc-unary-tcp')}) | {g/gt:.2f}× | (compare) |")
        report[name] = {"rdma_us": g, "tcp_us": gt, "ratio": g / gt}
# Per round, the async client's figure, the load, and its spin diagnostics
# (slow yields; waits that found the spin budget spent: see
# verbs/src/async/cq.rs "Spinning"), which say why a round was slow.
rows += ["", "| per round | figures (load; slow yields / budget-spent waits) |", "|---|---|"]
for name in ["async-lat-send-spin", "async-lat-write-imm-spin", "async-lat-fetch-add-spin",
             "stag-bw-write", "rdma-stream", "rdma-stream-slots", "rdma-stream-sends", "tcp-stream"]:
    if not have(name):
        continue
    cells = []
    for d in runs(name):
        r = d["results"][0] if "results" in d else d
        v = r.get("t_typical_us", r.get("bw_avg_mb_s"))
        diag = f"; {d['slow_yields']}/{d.get('spent_budget_waits', '-')}" if "slow_yields" in d else ""
        cells.append(f"{v:.1f} ({d.get('load', float('nan')):.1f}{diag})")
    rows.append(f"| {name} | {', '.join(cells)} |")
(out / "report.md").write_text("\n".join(rows) + "\n")
(out / "report.json").write_text(json.dumps(report, indent=2))
print("\n".join(rows))
PY
