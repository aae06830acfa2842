#!/usr/bin/env python3
"""The report of scripts/bench/bench-peers.sh: one markdown table, one JSON file.

    bench-report.py RAW OUT ROUNDS "MODES" ELAPSED_S "KNOBS" PROGRESS_FLAG

RAW/<round>/<name>.out holds each client's output (stag and `stag floor`
JSON, the C check's and fi_peer's JSON lines, ucx_perftest -f's final
line, fi_pingpong's table), <name>.{client,server}.time GNU time's "wall
user sys", <name>.failed the exit statuses of a run that failed. Every
figure is the median over the rounds (min and max beside it); a ratio is
one median over another.

With BENCH_BASE set (bench-peers.sh's BASE), the runs named base-* are a
second build measured in the same rounds, and the report adds a
before/after table; BENCH_THIS names this tree's build.
"""

import json
import os
import statistics
import sys

RAW, OUT, ROUNDS, MODES, ELAPSED, KNOBS, FLAG = sys.argv[1:8]
BASE = os.environ.get("BENCH_BASE") or None
THIS = os.environ.get("BENCH_THIS") or "this tree"
ROUNDS = int(ROUNDS)
MODES = MODES.split()
ROUND_DIRS = [os.path.join(RAW, str(r)) for r in range(1, ROUNDS + 1)]


def read(rdir, name, ext=".out"):
    try:
        with open(os.path.join(rdir, name + ext)) as f:
            return f.read()
    except OSError:
        return ""


def json_result(rdir, name, key):
    """results[0][key] of a JSON report (stag, stag floor, C check)."""
    try:
        return float(json.loads(read(rdir, name))["results"][0][key])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


UCX_FIELDS = ["iters", "p50", "avg", "overall", "bw_avg", "bw_overall", "rate_avg", "rate_overall"]


def ucx(rdir, name, key):
    """A field of ucx_perftest -f's final line (latency in us: one-way
    for *_lat tests, a round trip for get/atomics; bandwidth in MiB/s)."""
    for line in reversed(read(rdir, name).splitlines()):
        f = line.split()
        if len(f) == len(UCX_FIELDS):
            try:
                return float(f[UCX_FIELDS.index(key)])
            except ValueError:
                continue
    return None


def fi_pingpong(rdir, name):
    """fi_pingpong's usec/xfer: the average one-way time (no median)."""
    for line in read(rdir, name).splitlines():
        f = line.split()
        if len(f) == 8 and f[0][:1].isdigit():
            try:
                return float(f[6])
            except ValueError:
                pass
    return None


def cores_busy(rdir, name):
    """CPU seconds of client + server per second of the client's wall time."""
    try:
        cw, cu, cs = map(float, read(rdir, name, ".client.time").split()[-3:])
        _, su, ss = map(float, read(rdir, name, ".server.time").split()[-3:])
    except ValueError:
        return None
    return (cu + cs + su + ss) / cw if cw > 0 else None


def series(fn):
    """fn(round_dir) for every round, Nones dropped."""
    return [v for v in (fn(d) for d in ROUND_DIRS) if v is not None]


def agg(values):
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "samples": values,
    }


def med(a):
    return a["median"] if a else None


# ---- the floor ----------------------------------------------------------

def best(*vals, higher=True):
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    return max(vals) if higher else min(vals)


floor_raw = {
    "tcp_oneway_busy": agg(series(lambda d: json_result(d, "floor-lat-busy", "t_typical_us"))),
    "tcp_rtt_busy": agg(series(lambda d: json_result(d, "floor-lat-busy", "rtt_typical_us"))),
    "tcp_oneway_blocking": agg(series(lambda d: json_result(d, "floor-lat-blocking", "t_typical_us"))),
    "tcp_stream_busy": agg(series(lambda d: json_result(d, "floor-bw-busy", "bw_avg_mb_s"))),
    "tcp_stream_blocking": agg(series(lambda d: json_result(d, "floor-bw-blocking", "bw_avg_mb_s"))),
    "tcp_8streams_busy": agg(series(lambda d: json_result(d, "floor-streams8-busy", "msg_rate_mpps"))),
    "tcp_8streams_blocking": agg(series(lambda d: json_result(d, "floor-streams8-blocking", "msg_rate_mpps"))),
    "tcp_64streams_busy": agg(series(lambda d: json_result(d, "floor-streams64-busy", "msg_rate_mpps"))),
    "tcp_64streams_blocking": agg(series(lambda d: json_result(d, "floor-streams64-blocking", "msg_rate_mpps"))),
    "msync_8b": agg(series(lambda d: json_result(d, "msync", "t_typical_us"))),
}
c_check = {
    "tcp_oneway_busy": agg(series(lambda d: json_result(d, "c-lat-busy", "t_typical_us"))),
    "tcp_rtt_busy": agg(series(lambda d: json_result(d, "c-lat-busy", "rtt_typical_us"))),
    "tcp_oneway_blocking": agg(series(lambda d: json_result(d, "c-lat-blocking", "t_typical_us"))),
    "tcp_stream_busy": agg(series(lambda d: json_result(d, "c-bw-busy", "bw_avg_mb_s"))),
    "tcp_stream_blocking": agg(series(lambda d: json_result(d, "c-bw-blocking", "bw_avg_mb_s"))),
}

def per_round_best(*aggs, higher=True):
    """The best of several measurements taken in the same round, per
    round."""
    cols = [a["samples"] if a else [] for a in aggs]
    n = max(len(c) for c in cols)
    vals = [best(*(c[i] for c in cols if i < len(c)), higher=higher) for i in range(n)]
    return agg([v for v in vals if v is not None])


def paired_ratio(a, b):
    """Median over the rounds of a/b, each round's pair taken side by side."""
    if not a or not b:
        return None
    rs = [x / y for x, y in zip(a["samples"], b["samples"]) if y]
    return statistics.median(rs) if rs else None


# The Rust floor should be within 3% of the plain C program; with a few
# noisy samples a 3% difference cannot be told from noise, so the floor is,
# per round, the faster of the two (never slower than C), and the check
# rows show their paired ratio.
CHECK_TOLERANCE = 0.03
check_rows = []
for key, higher in [("tcp_oneway_busy", False), ("tcp_rtt_busy", False), ("tcp_oneway_blocking", False),
                    ("tcp_stream_busy", True), ("tcp_stream_blocking", True)]:
    r = paired_ratio(floor_raw[key], c_check[key])
    ok = None if r is None else (r <= 1 + CHECK_TOLERANCE if not higher
                                 else r >= 1 - CHECK_TOLERANCE)
    check_rows.append({"floor": key, "stag_floor": floor_raw[key], "c": c_check[key],
                       "paired_ratio": r, "within_3pct": ok})

floors = {
    "tcp_oneway_busy": per_round_best(floor_raw["tcp_oneway_busy"], c_check["tcp_oneway_busy"],
                                      higher=False),
    "tcp_rtt_busy": per_round_best(floor_raw["tcp_rtt_busy"], c_check["tcp_rtt_busy"],
                                   higher=False),
    "tcp_oneway_blocking": per_round_best(floor_raw["tcp_oneway_blocking"],
                                          c_check["tcp_oneway_blocking"], higher=False),
    # A stream's floor is the better mode: on a loaded 2-core machine a
    # blocking stream can beat a spinning one.
    "tcp_stream": per_round_best(floor_raw["tcp_stream_busy"], floor_raw["tcp_stream_blocking"],
                                 c_check["tcp_stream_busy"], c_check["tcp_stream_blocking"]),
    "tcp_8streams": per_round_best(floor_raw["tcp_8streams_busy"], floor_raw["tcp_8streams_blocking"]),
    # Issue #20's message-rate floor: the best of 8 or 64 streams, either mode.
    "tcp_streams": per_round_best(floor_raw["tcp_8streams_busy"], floor_raw["tcp_8streams_blocking"],
                                  floor_raw["tcp_64streams_busy"], floor_raw["tcp_64streams_blocking"]),
}
rtt, ms = floors["tcp_rtt_busy"], floor_raw["msync_8b"]
if rtt and ms and len(rtt["samples"]) == len(ms["samples"]):
    floors["tcp_rtt_plus_msync"] = agg([a + b for a, b in zip(rtt["samples"], ms["samples"])])
else:
    floors["tcp_rtt_plus_msync"] = None

FLOOR_LABEL = {
    "tcp_oneway_busy": "TCP ping-pong one-way (busy, best of stag floor/C)",
    "tcp_rtt_busy": "TCP round trip (busy, best of stag floor/C)",
    "tcp_oneway_blocking": "TCP ping-pong one-way (blocking, best of stag floor/C)",
    "tcp_stream": "TCP stream 1 MiB (best mode, stag floor/C)",
    "tcp_8streams": "8 TCP streams, 8 B (best mode)",
    "tcp_streams": "8 or 64 TCP streams, 8 B (best of both, best mode)",
    "tcp_rtt_plus_msync": "TCP round trip + msync(8 B)",
}

# ---- peers ---------------------------------------------------------------

LF_NA = ("n/a: no libfabric figure (fi_pingpong: send only; fi_peer.c: write, Read, FetchAdd, "
         "1 MiB Write/Read)")


def peer_fi_peer(prov, suffix, key, what):
    """fi_peer.c's figure over provider prov (tcp or verbs); a bandwidth
    (suffix bw-*) is, per round, the better of its busy and blocking runs,
    as the TCP stream's floor is."""
    if suffix.startswith("bw-"):
        value = per_round_best(*(agg(series(lambda d, m=m: json_result(d, f"fi-{prov}-{suffix}-{m}", key)))
                                 for m in ("busy", "blocking")))
    else:
        value = agg(series(lambda d: json_result(d, f"fi-{prov}-{suffix}", key)))
    return {"what": what, "value": value}


def peer_ucx(name, key):
    return {"what": f"ucx_perftest {name.removeprefix('ucx-')} (UCX_TLS=tcp)",
            "value": agg(series(lambda d: ucx(d, name, key)))}


def peer_fi(name, what):
    return {"what": what, "value": agg(series(lambda d: fi_pingpong(d, name)))}


# test label, stag run suffix, metric, unit, higher is better, floor key,
# target factor, UCX peer, libfabric peer (tcp;ofi_rxm), fi_peer's suffix
# (the same program over tcp;ofi_rxm and over stag0 through verbs;ofi_rxm)
TESTS = [
    ("lat write 8 B, one-way", "lat-write", "t_typical_us", "us", False, "tcp_oneway_busy", 1.1,
     None, None, "write"),
    ("lat send 8 B, one-way", "lat-send", "t_typical_us", "us", False, "tcp_oneway_busy", 1.1,
     lambda: peer_ucx("ucx-ucp_am_lat", "p50"),
     lambda: peer_fi("fi-pingpong-msg", "fi_pingpong -e msg, tcp (average)"), None),
    ("lat read 8 B, round trip", "lat-read", "t_typical_us", "us", False, "tcp_rtt_busy", 1.1,
     lambda: peer_ucx("ucx-ucp_get", "p50"), None, "read"),
    ("lat fetch-add, round trip", "lat-fetch-add", "t_typical_us", "us", False, "tcp_rtt_busy", 1.1,
     lambda: peer_ucx("ucx-ucp_fadd", "p50"), None, "fetch-add"),
    ("lat cmp-swap, round trip", "lat-cmp-swap", "t_typical_us", "us", False, "tcp_rtt_busy", 1.1,
     lambda: peer_ucx("ucx-ucp_cswap", "p50"), None, None),
    ("lat swap, round trip", "lat-swap", "t_typical_us", "us", False, "tcp_rtt_busy", 1.1,
     lambda: peer_ucx("ucx-ucp_swap", "p50"), None, None),
    ("lat commit 8 B (Write + Commit to a file)", "lat-commit", "t_typical_us", "us", False,
     "tcp_rtt_plus_msync", 1.0, None, None, None),
    ("lat send --blocking 8 B, one-way", "lat-send-blocking", "t_typical_us", "us", False,
     "tcp_oneway_blocking", 1.1, None, None, None),
    ("bw write 1 MiB", "bw-write", "bw_avg_mb_s", "MiB/s", True, "tcp_stream", 0.9,
     lambda: peer_ucx("ucx-ucp_put_bw", "bw_overall"), None, "bw-write"),
    ("bw read 1 MiB", "bw-read", "bw_avg_mb_s", "MiB/s", True, "tcp_stream", 0.9, None, None,
     "bw-read"),
    ("bw write 1 MiB, no MPA CRC", "bw-write-nocrc", "bw_avg_mb_s", "MiB/s", True, "tcp_stream",
     0.9, None, None, None),
    ("bw read 1 MiB, no MPA CRC", "bw-read-nocrc", "bw_avg_mb_s", "MiB/s", True, "tcp_stream",
     0.9, None, None, None),
    ("bw write 8 B, 64 QPs, message rate", "bw-write-qps64", "msg_rate_mpps", "Mpps", True,
     "tcp_streams", 0.9, None, None, None),
    ("bw write 8 B, 256 QPs, message rate", "bw-write-qps256", "msg_rate_mpps", "Mpps", True,
     "tcp_streams", None, None, None, None),
    ("bw write 8 B, 1024 QPs, message rate", "bw-write-qps1024", "msg_rate_mpps", "Mpps", True,
     "tcp_streams", 0.8, None, None, None),
]


def fmt(x, unit=""):
    if x is None:
        return "n/a"
    d = 3 if unit == "Mpps" else (1 if abs(x) >= 100 else 2)
    return f"{x:.{d}f}"


def fmt_agg(a, unit):
    if not a:
        return "n/a"
    return f"{fmt(a['median'], unit)} ({fmt(a['min'], unit)}–{fmt(a['max'], unit)})"


def ratio(a, b):
    return a / b if a is not None and b else None


rows = []
for label, suffix, key, unit, higher, fkey, factor, ucx_peer, fi_peer, fi_op in TESTS:
    fl = floors.get(fkey)
    ucx_v = ucx_peer() if ucx_peer else None
    fi_v = fi_peer() if fi_peer else None
    if fi_op:
        fi_v = peer_fi_peer("tcp", fi_op, key, f"fi_peer {fi_op}, tcp;ofi_rxm (FI_EP_RDM)")
    fi_stag = None
    if fi_op:
        fi_stag = peer_fi_peer("verbs", fi_op, key,
                               f"fi_peer {fi_op}, verbs;ofi_rxm on stag0 (stag run; busy)")
    for mode in MODES:
        name = f"stag-{mode}-{suffix}"
        stag_v = agg(series(lambda d: json_result(d, name, key)))
        r = ratio(med(stag_v), med(fl))
        met = None if r is None or factor is None else (r >= factor if higher else r <= factor)
        bw_peak = None
        if unit == "MiB/s":
            bw_peak = agg(series(lambda d: json_result(d, name, "bw_peak_mb_s")))
        rows.append({
            "test": label, "progress": mode, "unit": unit,
            "higher_is_better": higher,
            "stag": stag_v, "bw_peak_mb_s": bw_peak,
            "floor": fkey, "floor_label": FLOOR_LABEL[fkey], "floor_value": fl,
            "stag_over_floor": r,
            "target": "none" if factor is None else f"{'≥' if higher else '≤'} {factor}× floor",
            "met": met,
            "cores_busy": agg(series(lambda d: cores_busy(d, name))),
            "ucx": ucx_v and {**ucx_v, "over_floor": ratio(med(ucx_v["value"]), med(fl))},
            "libfabric": fi_v and {**fi_v, "over_floor": ratio(med(fi_v["value"]), med(fl))},
            "libfabric_on_stag0": fi_stag and {**fi_stag,
                                               "over_floor": ratio(med(fi_stag["value"]), med(fl))},
        })


def peer_cell(p, na):
    if not p:
        return na
    if not p["value"]:
        return "n/a (did not run)"
    return f"{fmt(med(p['value']))} ({fmt(p['over_floor'])}×)"


md = [
    f"# stag vs its floor and peers ({ROUNDS} round(s), two processes on 127.0.0.1)",
    "",
    f"Knobs: {KNOBS}; progress modes: {' '.join(MODES)} "
    f"({'--progress flag' if FLAG == '1' else 'STAG_PROGRESS only: this stag has no --progress flag'}). "
    f"Script time: {ELAPSED} s.",
    "",
    "Each figure: median of the rounds (min–max). Latency: typical (median) of the run, lower is "
    "better; bandwidth: MiB/s average, message rate: Mpps, higher is better. ratio = stag / floor. "
    "cores = CPU seconds (user + sys, client + server, connection setup included) per second of "
    "the client's wall time. UCX/libfabric: their figure (their / floor); libfabric's RMA, "
    "atomic and bandwidth figures are fi_peer.c's (FI_EP_RDM, busy polling; bandwidth the better "
    "of busy and blocking), over tcp;ofi_rxm and over stag0 through verbs;ofi_rxm.",
    "",
    "| test | progress | stag | floor | floor value | stag/floor | target | met | cores | UCX (tcp) | libfabric (tcp;ofi_rxm) | libfabric on stag0 (verbs;ofi_rxm) |",
    "| --- | --- | ---: | --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |",
]
MET = {True: "met", False: "**missed**", None: "n/a"}
for row in rows:
    unit = row["unit"]
    met = MET[row["met"]]
    md.append(
        f"| {row['test']} [{unit}] | {row['progress']} | {fmt_agg(row['stag'], unit)} | "
        f"{row['floor_label']} | {fmt_agg(row['floor_value'], unit)} | "
        f"{fmt(row['stag_over_floor'])} | {row['target']} | {met} | "
        f"{fmt(med(row['cores_busy']))} | {peer_cell(row['ucx'], 'n/a')} | "
        f"{peer_cell(row['libfabric'], 'n/a¹')} | {peer_cell(row['libfabric_on_stag0'], 'n/a¹')} |"
    )
# The floor itself, and its check against plain C, in the same table.
for key, label, unit in [
    ("tcp_oneway_busy", "floor: TCP ping-pong one-way, busy", "us"),
    ("tcp_rtt_busy", "floor: TCP round trip, busy", "us"),
    ("tcp_oneway_blocking", "floor: TCP ping-pong one-way, blocking", "us"),
    ("tcp_stream_busy", "floor: TCP stream 1 MiB, busy", "MiB/s"),
    ("tcp_stream_blocking", "floor: TCP stream 1 MiB, blocking", "MiB/s"),
]:
    c = c_check[key]
    check = next(x for x in check_rows if x["floor"] == key)
    met = MET[check["within_3pct"]]
    md.append(
        f"| {label} [{unit}] | — | {fmt_agg(floor_raw[key], unit)} (stag floor) | plain C "
        f"(scripts/bench/floor_check.c) | {fmt_agg(c, unit)} | {fmt(check['paired_ratio'])} (paired) | "
        f"within 3% of C | {met} | — | — | — | — |"
    )
for key, label, unit in [
    ("tcp_8streams_busy", "floor: 8 TCP streams of 8 B, busy", "Mpps"),
    ("tcp_8streams_blocking", "floor: 8 TCP streams of 8 B, blocking", "Mpps"),
    ("tcp_64streams_busy", "floor: 64 TCP streams of 8 B, busy", "Mpps"),
    ("tcp_64streams_blocking", "floor: 64 TCP streams of 8 B, blocking", "Mpps"),
    ("msync_8b", "floor: msync of 8 dirty bytes (file in $TMPDIR)", "us"),
]:
    md.append(f"| {label} [{unit}] | — | {fmt_agg(floor_raw[key], unit)} | — | — | — | — | — | — | — | — | — |")

# ---- scale ---------------------------------------------------------------


def scale_field(rdir, role, key, name="scale"):
    """A field of `stag scale --json` (the client's line in NAME.out, the
    server's in NAME.server)."""
    text = read(rdir, name, ".out" if role == "client" else ".server")
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                return float(json.loads(line)[key])
            except (ValueError, KeyError, TypeError):
                return None
    return None


def cmtime_rate(rdir, name="cmtime"):
    """Connections set up per second through rdma_cm, all from cmtime's own
    output: its connections over the sum of its setup steps' wall times
    (each step runs for all connections at once; disconnect and destroy are
    not setup). cmtime prints, per step, the total in ms and the time per
    connection in us, so their quotient is its connection count (taken from
    the step with the largest total, where the rounding matters least); the
    connections it reports failed ("event: ..." lines) are left out."""
    total_ms, n, widest = 0.0, None, 0.0
    failed = 0
    for line in read(rdir, name).splitlines():
        if line.startswith("event:"):
            failed += 1
            continue
        f = line.replace(":", " ").split()
        if len(f) >= 5 and f[0] in ("create", "resolve", "connect"):
            try:
                step_ms, per_conn_us = float(f[-4]), float(f[-1])
            except ValueError:
                return None
            total_ms += step_ms
            if step_ms > widest and per_conn_us > 0:
                widest, n = step_ms, round(step_ms * 1000.0 / per_conn_us)
    if not n or total_ms <= 0 or failed >= n:
        return None
    return (n - failed) / (total_ms / 1000.0)


def scale_tests(pre=""):
    """The scale measurements of one build: pre "" for this tree, "base-"
    for the base."""
    sc, cm = pre + "scale", pre + "cmtime"
    return [
        ("memory per connected idle QP, client (RSS)",
         lambda d: scale_field(d, "client", "rss_per_qp_kib", sc), "KiB", False, 64),
        ("memory per connected idle QP, server (RSS)",
         lambda d: scale_field(d, "server", "rss_per_qp_kib", sc), "KiB", False, 64),
        ("idle CPU, client process, all QPs connected",
         lambda d: scale_field(d, "client", "idle_cpu_pct", sc), "% of a core", False, 1),
        ("idle CPU, server process, all QPs connected",
         lambda d: scale_field(d, "server", "idle_cpu_pct", sc), "% of a core", False, 1),
        ("connections per second, verbs::connect one after another",
         lambda d: scale_field(d, "client", "connects_per_s", sc), "1/s", True, None),
        ("connections per second, rdma_cm (cmtime, all at once)",
         lambda d: cmtime_rate(d, cm), "1/s", True, 2000),
        ("QPs alive after the idle period",
         lambda d: scale_field(d, "client", "alive", sc), "QPs", True, None),
    ]


scale_rows = []
for label, fn, unit, higher, target in scale_tests():
    v = agg(series(fn))
    met = None
    if v and target is not None:
        met = v["median"] >= target if higher else v["median"] <= target
    scale_rows.append({"test": label, "unit": unit, "value": v, "target": target,
                       "higher_is_better": higher, "met": met})
md += [
    "",
    "Scale (`stag scale` and `cmtime`, two processes):",
    "",
    "| measurement | value | target | met |",
    "| --- | ---: | --- | --- |",
]
for row in scale_rows:
    t = row["target"]
    tgt = "none" if t is None else f"{'≥' if row['higher_is_better'] else '≤'} {t} {row['unit']}"
    md.append(f"| {row['test']} [{row['unit']}] | {fmt_agg(row['value'], row['unit'])} | {tgt} | "
              f"{MET[row['met']]} |")
# ---- before/after ------------------------------------------------------


def by_round(fn):
    """fn(round_dir) for every round, None where a run left no figure."""
    return [fn(d) for d in ROUND_DIRS]


def compare(this_fn, base_fn, higher):
    """This build against the base over the same rounds: both series, the
    median over the rounds of this/base (each round's pair measured back to
    back), and a verdict. The two are within noise when their ranges over
    the rounds overlap; otherwise this build is better or worse."""
    t, b = by_round(this_fn), by_round(base_fn)
    pairs = [x / y for x, y in zip(t, b) if x is not None and y]
    ta, ba = agg([x for x in t if x is not None]), agg([y for y in b if y is not None])
    verdict = None
    if ta and ba:
        if ta["min"] <= ba["max"] and ba["min"] <= ta["max"]:
            verdict = "within noise"
        else:
            verdict = "better" if (ta["median"] > ba["median"]) == higher else "worse"
    return {"this": ta, "base": ba, "paired_ratio": statistics.median(pairs) if pairs else None,
            "verdict": verdict}


before_after = []
if BASE:
    for label, suffix, key, unit, higher, *_ in TESTS:
        for mode in MODES:
            c = compare(lambda d: json_result(d, f"stag-{mode}-{suffix}", key),
                        lambda d: json_result(d, f"base-{mode}-{suffix}", key), higher)
            before_after.append({"test": label, "progress": mode, "unit": unit,
                                 "higher_is_better": higher, **c})
    for (label, fn, unit, higher, _), (_, base_fn, *_) in zip(scale_tests(), scale_tests("base-")):
        c = compare(fn, base_fn, higher)
        before_after.append({"test": label, "progress": "—", "unit": unit,
                             "higher_is_better": higher, **c})
    md += [
        "",
        f"Before/after, one run: this tree ({THIS}) against the base ({BASE}), every pair measured "
        "back to back in each round, the order alternating from round to round. ratio = this / "
        "base, the median of the rounds' paired ratios; within noise = the two ranges overlap.",
        "",
        "| test | progress | base | this | this/base | verdict |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for row in before_after:
        unit = row["unit"]
        md.append(f"| {row['test']} [{unit}] | {row['progress']} | {fmt_agg(row['base'], unit)} | "
                  f"{fmt_agg(row['this'], unit)} | {fmt(row['paired_ratio'])} | "
                  f"{row['verdict'] or 'n/a'} |")

# Runs that failed (a client's exit status, or either side killed by a
# signal: bench-peers.sh leaves NAME.failed and no figure).
failed_runs = []
for r, d in enumerate(ROUND_DIRS, 1):
    try:
        names = sorted(n for n in os.listdir(d) if n.endswith(".failed"))
    except OSError:
        names = []
    for n in names:
        failed_runs.append({"round": r, "run": n.removesuffix(".failed"),
                            "status": read(d, n, "").strip()})
md += [
    "",
    f"¹ {LF_NA}. fi_pingpong reports an average one-way time, not a median. UCX's "
    "ucp_get/ucp_fadd/ucp_cswap/ucp_swap are round trips, ucp_am_lat one-way; ucp_put_bw is "
    "MiB/s. Raw outputs: " + RAW,
    "",
    "Failed runs (no figure taken): " + ("none" if not failed_runs else "; ".join(
        f"round {f['round']} {f['run']} ({f['status']})" for f in failed_runs)),
]
text = "\n".join(md) + "\n"
with open(os.path.join(OUT, "report.md"), "w") as f:
    f.write(text)
with open(os.path.join(OUT, "report.json"), "w") as f:
    json.dump({
        "rounds": ROUNDS, "progress_modes": MODES, "progress_flag": FLAG == "1",
        "knobs": KNOBS, "elapsed_s": int(ELAPSED),
        "floors": floors, "floor_raw": floor_raw, "c_check": check_rows,
        "rows": rows, "scale": scale_rows, "libfabric_missing": LF_NA,
        "failed_runs": failed_runs,
        "base": BASE, "this": THIS, "before_after": before_after,
    }, f, indent=2)
print(text)
