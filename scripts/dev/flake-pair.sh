#!/usr/bin/env bash
# Run one server/client pair of an unmodified C program under `stag run`
# many times, to reproduce a failure that shows up once in hundreds of runs
# (issue #19's fi_pingpong SIGSEGV). Not part of the gate: a tool for
# hunting a flaky case down to its cause.
#
#   scripts/dev/flake-pair.sh [-n RUNS] [-u USER] [-p PORT] [-m] [-- SERVER_ARGS -- CLIENT_ARGS]
#
# Defaults to rdma-core-apps.sh's fi_pingpong case (with -I 10, so that a
# run takes about a second). PORT (default 23000) should be below the
# kernel's ephemeral range so that other programs' connections do not take
# it; `{port}` in the arguments is replaced with each run's port. -m adds
# glibc's malloc checker (libc_malloc_debug, MALLOC_CHECK_=3), which turns
# heap corruption into an abort at the first free that sees it.
#
# Each failing run keeps its logs in target/flake-pair/RUN.{server,client}.log;
# with core dumps enabled (ulimit -c unlimited, set here) and
# /proc/sys/kernel/core_pattern pointing to a writable directory, a crash
# leaves a core to open with gdb. The libinfinipath/psm2 libraries libfabric
# loads install a SIGSEGV/SIGABRT handler that prints a backtrace and exits
# 1 instead of dumping core; IPATH_NO_BACKTRACE/HFI_NO_BACKTRACE turn it off.
#
# Prints "flake-pair: N passed, M failed"; exits non-zero if any run failed.
set -uo pipefail
cd "$(dirname "$0")/../.."

runs=200 user=root port=23000 mdebug=0
while getopts "n:u:p:m" o; do
    case $o in
    n) runs=$OPTARG ;;
    u) user=$OPTARG ;;
    p) port=$OPTARG ;;
    m) mdebug=1 ;;
    *) exit 2 ;;
    esac
done
shift $((OPTIND - 1))
server='fi_pingpong -p verbs -e msg -B {port} -I 10'
client='fi_pingpong -p verbs -e msg -P {port} -I 10 127.0.0.1'
# getopts has taken the first `--`: SERVER_ARGS -- CLIENT_ARGS remain.
if (($#)); then
    s=() c=()
    while (($#)) && [[ $1 != -- ]]; do s+=("$1") && shift; done
    (($#)) && shift
    c=("$@")
    server=${s[*]} client=${c[*]}
fi

cargo build --quiet -p stag -p stag-rdma || exit 1
STAG=$PWD/target/debug/stag
out=$PWD/target/flake-pair
rm -rf "$out" && mkdir -p "$out" && chmod 777 "$out"
source scripts/lib/common.sh

export IPATH_NO_BACKTRACE=1 HFI_NO_BACKTRACE=1
if ((mdebug)); then
    export LD_PRELOAD=/lib/x86_64-linux-gnu/libc_malloc_debug.so.0 MALLOC_CHECK_=3
fi
ulimit -c unlimited

# as USER CMD...: CMD as USER (root: directly), core dumps allowed.
as() {
    local u=$1
    shift
    if [[ $u == root ]]; then
        "$@"
    else
        runuser -u "$u" -- bash -c 'ulimit -c unlimited; exec "$@"' as "$@"
    fi
}

passed=0 failed=0
for ((i = 1; i <= runs; i++)); do
    p=$((port + i % 500))
    as "$user" timeout 60 "$STAG" run -- ${server//\{port\}/$p} >"$out/server.log" 2>&1 &
    spid=$!
    ok=1 crc=-
    if wait_port "$p"; then
        as "$user" timeout 60 "$STAG" run -- ${client//\{port\}/$p} >"$out/client.log" 2>&1
        crc=$?
        ((crc)) && ok=0
    else
        ok=0
    fi
    # A server whose client failed would wait for its timeout.
    ((ok)) || kill "$spid" 2>/dev/null
    wait "$spid"
    src=$?
    ((src)) && ok=0
    if ((ok)); then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        echo "FAIL  run $i (port $p): client exit $crc, server exit $src"
        mv "$out/server.log" "$out/$i.server.log"
        mv "$out/client.log" "$out/$i.client.log"
        tail -n 5 "$out/$i.client.log"
    fi
done
echo "flake-pair: $passed passed, $failed failed"
((failed == 0))
