#!/usr/bin/env bash
# Unmodified rdma-core programs on stag0 against the same programs on
# kernel siw0, in both directions: the interop check with a peer nobody
# here wrote. stag0's side runs under `stag run` (stag's plugin and rdma_cm,
# over the guest's TCP), siw0's side is plain Debian (kernel rdma_cm and
# siw). Prints `rdma-core-siw: N passed, M failed`.
#
#   scripts/vm/vm.sh -- scripts/vm/rdma-core-siw.sh      (build first: cargo build -p stag -p stag-rdma)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
[[ ${STAG_IN_VM:-0} == 1 ]] || { echo "rdma-core-siw.sh: run me inside scripts/vm/vm.sh" >&2; exit 2; }
STAG=${CARGO_TARGET_DIR:-$PWD/target}/debug/stag
[[ -x $STAG ]] || { echo "rdma-core-siw.sh: $STAG not built" >&2; exit 2; }
addr=${STAG_SIW_ADDR:?}
out=$(mktemp -d)
passed=0 failed=0

source scripts/lib/common.sh

# run_pair NAME PORT SERVER_SIDE(stag|siw) 'SERVER ARGS' 'CLIENT ARGS' PATTERN:
# one run of server and client; 0 when both exit 0 and the client's output
# matches PATTERN.
run_pair() {
    local name=$1 port=$2 side=$3 server=$4 client=$5 pattern=$6
    local srun=() crun=()
    if [[ $side == stag ]]; then srun=("$STAG" run --); else crun=("$STAG" run --); fi
    timeout 120 "${srun[@]}" $server >"$out/$name.server" 2>&1 &
    local spid=$! ok=1
    wait_port "$port" || ok=0
    ((ok)) && { timeout 120 "${crun[@]}" $client >"$out/$name.client" 2>&1 || ok=0; }
    wait "$spid" || ok=0
    ((ok)) && grep -Eq "$pattern" "$out/$name.client" && return 0
    kill "$spid" 2>/dev/null
    return 1
}

# case_ NAME PORT ...: one run; nothing is retried. (perftest's kernel-side
# client against a stag0 server was refused on its second rdma_cm
# connection about one run in five: perftest's server re-binds the port
# of its first listener only after a message exchange, and its client may
# connect first. stag's rdma_cm now hands a destroyed listener's port to a
# re-bind of the same address, see provider/plugin/src/cm/listen.rs.)
case_() {
    local name=$1
    shift
    if run_pair "$name" "$@"; then
        passed=$((passed + 1))
        echo "ok    $name"
        return
    fi
    failed=$((failed + 1))
    echo "FAIL  $name"
    tail -n 12 "$out/$name.server" "$out/$name.client" | sed 's/^/  /'
    dmesg 2>/dev/null | grep -i siw | tail -n 5 | sed 's/^/  dmesg: /'
}

# The kernel's side names siw0 explicitly; stag0's side names stag0.
case_ rping-stag-server 22001 stag "rping -s -a $addr -p 22001 -C 200 -V" \
    "rping -c -a $addr -p 22001 -C 200 -V -v" 'ping data: rdma-ping-199: ' 
case_ rping-siw-server 22002 siw "rping -s -a $addr -p 22002 -C 200 -V" \
    "rping -c -a $addr -p 22002 -C 200 -V -v" 'ping data: rdma-ping-199: ' 
case_ ib_write_lat-stag-server 22003 stag "ib_write_lat -R -d stag0 -p 22003 -n 200 -s 64" \
    "ib_write_lat -R -d siw0 -p 22003 -n 200 -s 64 $addr" '^ *64 '
# No ib_write_lat with the kernel as server: Debian's perftest 4.5-0.17
# server re-binds its port only after a message exchange, and a client that
# connects first is refused by the kernel's rdma_cm, which perftest cannot
# retry (upstream fixed its retry in Dec 2025, 3d9d8d0 and e2b3dcf). That
# race is between perftest and the kernel, not stag: it failed 1 run in 5
# here. rping-siw-server covers stag0 as the client of a kernel server.
rm -rf "$out"
echo "rdma-core-siw: $passed passed, $failed failed"
((failed == 0 && passed > 0))
