#!/usr/bin/env bash
# stag next to its peers, on loopback: `stag lat/bw --loopback` against
# UCX (ucx_perftest, UCX_TLS=tcp), libfabric (fi_pingpong, tcp provider)
# and a raw TCP ping-pong/stream in C. Writes one markdown and one JSON
# table with ratios (stag / peer) to $OUT (default target/bench-peers).
#
# Runs are short on purpose (the machine may be shared): ITERS (default
# 2000) messages per test. Numbers on a loaded machine are noisy; compare
# typical (median) latencies, and run it twice.
#
#   scripts/bench-peers.sh [--no-install]
#
# Needs: cargo, gcc, python3; installs ucx-utils and libfabric-bin from
# Debian unless --no-install (then missing peers are skipped).
set -euo pipefail

cd "$(dirname "$0")/.."
ITERS=${ITERS:-2000}
LAT_SIZE=${LAT_SIZE:-8}
BW_SIZE=${BW_SIZE:-65536}
OUT=${OUT:-target/bench-peers}
INSTALL=1
[[ ${1:-} == --no-install ]] && INSTALL=0
mkdir -p "$OUT"
RAW="$OUT/raw"
rm -rf "$RAW"
mkdir -p "$RAW"

log() { printf '# %s\n' "$*" >&2; }

if [[ $INSTALL == 1 ]]; then
    need=()
    command -v ucx_perftest >/dev/null || need+=(ucx-utils)
    command -v fi_pingpong >/dev/null || need+=(libfabric-bin)
    if ((${#need[@]})); then
        log "installing ${need[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q >/dev/null
        apt-get install -y -q "${need[@]}" >/dev/null
    fi
fi

log "building stag (release)"
cargo build --release -q -p stag
STAG=target/release/stag
export STAG_DEVICE=stag0

# Raw TCP: ping-pong latency (one-way = RTT/2) and a one-way stream.
cat >"$RAW/tcp_pp.c" <<'EOF'
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static void full(int fd, char *b, size_t n, int rd) {
    size_t d = 0;
    while (d < n) {
        ssize_t k = rd ? read(fd, b + d, n - d) : write(fd, b + d, n - d);
        if (k <= 0) { perror("io"); exit(1); }
        d += (size_t)k;
    }
}
static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
/* tcp_pp lat|bw server|client PORT SIZE ITERS */
int main(int argc, char **argv) {
    if (argc != 6) return 2;
    int bw = !strcmp(argv[1], "bw"), server = !strcmp(argv[2], "server");
    int port = atoi(argv[3]);
    size_t size = (size_t)atol(argv[4]);
    long iters = atol(argv[5]);
    char *buf = calloc(1, size);
    int one = 1, fd;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (server) {
        int l = socket(AF_INET, SOCK_STREAM, 0);
        setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(l, (void *)&a, sizeof a) || listen(l, 1)) { perror("listen"); return 1; }
        fd = accept(l, 0, 0);
    } else {
        fd = socket(AF_INET, SOCK_STREAM, 0);
        int tries = 0;
        while (connect(fd, (void *)&a, sizeof a)) {
            if (++tries > 100) { perror("connect"); return 1; }
            usleep(20000);
            close(fd);
            fd = socket(AF_INET, SOCK_STREAM, 0);
        }
    }
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (bw) {
        if (server) {
            for (long i = 0; i < iters; i++) full(fd, buf, size, 1);
            full(fd, buf, 1, 0);
        } else {
            double t0 = now_us();
            for (long i = 0; i < iters; i++) full(fd, buf, size, 0);
            full(fd, buf, 1, 1);
            double s = (now_us() - t0) / 1e6;
            printf("{\"bw_avg_mb_s\": %.3f, \"msg_rate_mpps\": %.6f}\n",
                   size * (double)iters / s / 1048576.0, iters / s / 1e6);
        }
        return 0;
    }
    long warm = iters < 100 ? iters : 100;
    double *t = calloc((size_t)iters, sizeof *t);
    for (long i = 0; i < warm + iters; i++) {
        double t0 = now_us();
        if (server) { full(fd, buf, size, 1); full(fd, buf, size, 0); }
        else { full(fd, buf, size, 0); full(fd, buf, size, 1); }
        if (i >= warm) t[i - warm] = (now_us() - t0) / 2;
    }
    if (!server) {
        double sum = 0;
        for (long i = 0; i < iters; i++) sum += t[i];
        qsort(t, (size_t)iters, sizeof *t, cmp);
        printf("{\"t_typical_us\": %.3f, \"t_avg_us\": %.3f}\n", t[iters / 2], sum / iters);
    }
    return 0;
}
EOF
gcc -O2 -o "$RAW/tcp_pp" "$RAW/tcp_pp.c"

# Each peer pair: server in the background, client in the foreground.
pair() { # name, server cmd..., --, client cmd...
    local name=$1
    shift
    local srv=()
    while [[ $1 != -- ]]; do
        srv+=("$1")
        shift
    done
    shift
    timeout 120 "${srv[@]}" >"$RAW/$name.server" 2>&1 &
    local pid=$!
    sleep 0.5
    if ! timeout 120 "$@" >"$RAW/$name.out" 2>"$RAW/$name.err"; then
        log "$name failed (see $RAW/$name.err)"
    fi
    wait "$pid" 2>/dev/null || true
}

log "stag"
$STAG lat write --loopback -n "$ITERS" -s "$LAT_SIZE" --json >"$RAW/stag-lat-write.out"
$STAG lat send --loopback -n "$ITERS" -s "$LAT_SIZE" --json >"$RAW/stag-lat-send.out"
$STAG lat send --loopback -n "$ITERS" -s "$LAT_SIZE" --blocking --json >"$RAW/stag-lat-send-blocking.out"
$STAG lat read --loopback -n "$ITERS" -s "$LAT_SIZE" --json >"$RAW/stag-lat-read.out"
$STAG bw write --loopback -n "$ITERS" -s "$BW_SIZE" --json >"$RAW/stag-bw-write.out"
$STAG bw send --loopback -n "$ITERS" -s "$BW_SIZE" --json >"$RAW/stag-bw-send.out"

log "raw TCP"
pair tcp-lat "$RAW/tcp_pp" lat server 13378 "$LAT_SIZE" "$ITERS" -- \
    "$RAW/tcp_pp" lat client 13378 "$LAT_SIZE" "$ITERS"
pair tcp-bw "$RAW/tcp_pp" bw server 13379 "$BW_SIZE" "$ITERS" -- \
    "$RAW/tcp_pp" bw client 13379 "$BW_SIZE" "$ITERS"

if command -v ucx_perftest >/dev/null; then
    log "UCX (tcp)"
    export UCX_TLS=tcp
    pair ucx-tag-lat ucx_perftest -p 13380 -- \
        ucx_perftest 127.0.0.1 -p 13380 -t tag_lat -n "$ITERS" -s "$LAT_SIZE"
    pair ucx-tag-bw ucx_perftest -p 13381 -- \
        ucx_perftest 127.0.0.1 -p 13381 -t tag_bw -n "$ITERS" -s "$BW_SIZE"
    unset UCX_TLS
fi
if command -v fi_pingpong >/dev/null; then
    log "libfabric (tcp provider, msg endpoints)"
    pair fi-pingpong fi_pingpong -p tcp -e msg -B 13382 -I "$ITERS" -S "$LAT_SIZE" -- \
        fi_pingpong -p tcp -e msg -P 13382 -I "$ITERS" -S "$LAT_SIZE" 127.0.0.1
fi

python3 - "$RAW" "$OUT" "$ITERS" "$LAT_SIZE" "$BW_SIZE" <<'EOF'
import json, os, sys
raw, out, iters, lat_size, bw_size = sys.argv[1:]

def load(name):
    p = os.path.join(raw, name + ".out")
    try:
        return open(p).read()
    except OSError:
        return ""

def stag(name, key):
    try:
        return json.loads(load(name))["results"][0][key]
    except (ValueError, KeyError, IndexError):
        return None

def ucx_final(name):
    # Final: iters p50 avg overall bw_avg bw_overall rate_avg rate_overall
    for line in load(name).splitlines():
        if line.startswith("Final:"):
            f = line.split()
            return {"p50": float(f[2]), "avg": float(f[3]), "bw": float(f[5])}
    return None

def fi_pp(name):
    # bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec
    lines = [l.split() for l in load(name).splitlines() if l[:1].isdigit()]
    return float(lines[-1][6]) if lines else None

def tcp(name, key):
    try:
        return json.loads(load(name))[key]
    except (ValueError, KeyError):
        return None

u_lat, u_bw = ucx_final("ucx-tag-lat"), ucx_final("ucx-tag-bw")
lat = [
    ("stag lat write (busy poll)", stag("stag-lat-write", "t_typical_us"), stag("stag-lat-write", "t_avg_us")),
    ("stag lat send (busy poll)", stag("stag-lat-send", "t_typical_us"), stag("stag-lat-send", "t_avg_us")),
    ("stag lat send (blocking)", stag("stag-lat-send-blocking", "t_typical_us"), stag("stag-lat-send-blocking", "t_avg_us")),
    ("stag lat read (round trip)", stag("stag-lat-read", "t_typical_us"), stag("stag-lat-read", "t_avg_us")),
    ("raw TCP ping-pong", tcp("tcp-lat", "t_typical_us"), tcp("tcp-lat", "t_avg_us")),
    ("ucx_perftest tag_lat (UCX_TLS=tcp)", u_lat and u_lat["p50"], u_lat and u_lat["avg"]),
    ("fi_pingpong (tcp, msg)", None, fi_pp("fi-pingpong")),
]
bw = [
    ("stag bw write", stag("stag-bw-write", "bw_avg_mb_s")),
    ("stag bw send", stag("stag-bw-send", "bw_avg_mb_s")),
    ("raw TCP stream", tcp("tcp-bw", "bw_avg_mb_s")),
    ("ucx_perftest tag_bw (UCX_TLS=tcp)", u_bw and u_bw["bw"]),
]
ref_lat = lat[0][1] or lat[0][2]
ref_bw = bw[0][1]

def fmt(x, d=2):
    return "n/a" if x is None else f"{x:.{d}f}"

def ratio(a, b):
    return None if not a or not b else a / b

md = [f"# stag vs peers on loopback ({iters} iterations; latency {lat_size} B, bandwidth {bw_size} B)", "",
      "One-way latency (ping-pong RTT/2; read is a full round trip). Ratio = stag lat write typical / this row (> 1: stag slower).", "",
      "| test | typical [us] | average [us] | stag write / this |", "| --- | ---: | ---: | ---: |"]
rows = {"latency": [], "bandwidth": []}
for name, typ, avg in lat:
    r = ratio(ref_lat, typ if typ is not None else avg)
    md.append(f"| {name} | {fmt(typ)} | {fmt(avg)} | {fmt(r)} |")
    rows["latency"].append({"test": name, "t_typical_us": typ, "t_avg_us": avg, "stag_write_over_this": r})
md += ["", "Bandwidth (MiB/s). Ratio = stag bw write / this row (< 1: stag slower).", "",
       "| test | average [MiB/s] | stag write / this |", "| --- | ---: | ---: |"]
for name, v in bw:
    r = ratio(ref_bw, v)
    md.append(f"| {name} | {fmt(v)} | {fmt(r)} |")
    rows["bandwidth"].append({"test": name, "bw_avg_mb_s": v, "stag_write_over_this": r})
md.append("")
md.append("fi_pingpong prints only an average (usec/xfer, one-way). Raw outputs: " + raw)
open(os.path.join(out, "report.md"), "w").write("\n".join(md) + "\n")
json.dump({"iterations": int(iters), "lat_size": int(lat_size), "bw_size": int(bw_size), **rows},
          open(os.path.join(out, "report.json"), "w"), indent=2)
print("\n".join(md))
EOF
log "wrote $OUT/report.md and $OUT/report.json"
