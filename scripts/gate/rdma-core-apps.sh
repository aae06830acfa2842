#!/usr/bin/env bash
# Unmodified rdma-core programs on stag0, the userspace iWARP device, with
# no kernel RDMA: Debian's own ibverbs-utils, rdmacm-utils, perftest and
# libfabric binaries, each run as a server and a client process over
# 127.0.0.1 through `stag run` (which preloads stag's libibverbs plugin and
# rdma_cm), as root and as an ordinary user; the stagdv.h C example; and
# `stag install`, after which a plain login shell's ibv_devices lists
# stag0. Prints "rdma-core-apps: N passed, M failed" and exits non-zero on any
# failure.
#
#   scripts/gate/rdma-core-apps.sh [--quick]     (--quick: root only, no install check)
set -uo pipefail
cd "$(dirname "$0")/../.."
QUICK=0
[[ ${1:-} == --quick ]] && QUICK=1

cargo build --quiet -p stag -p stag-rdma || exit 1
STAG=$PWD/target/debug/stag
out=$PWD/target/rdma-core
rm -rf "$out" && mkdir -p "$out"
chmod 755 "$out"
cc -Wall -Wextra -Werror -O1 -Iprovider/plugin/include -Iprovider/plugin/tests/c -o "$out/stagdv_demo" \
    examples/c/stagdv_demo.c -L target/debug -Wl,-rpath,"$PWD/target/debug" \
    -lstag_rdmav34 -lrdmacm -libverbs -lpthread || exit 1
cc -Wall -Wextra -Werror -O1 -Iprovider/plugin/tests/c -o "$out/verbs_errors" provider/plugin/tests/c/verbs_errors.c -libverbs || exit 1
cc -Wall -Wextra -Werror -O1 -Iprovider/plugin/tests/c -o "$out/cm_edge" provider/plugin/src/cm/tests/cm_edge.c -lrdmacm -libverbs -lpthread || exit 1
cc -Wall -Wextra -Werror -O1 -Iprovider/plugin/tests/c -o "$out/cm_gaps" provider/plugin/src/cm/tests/cm_gaps.c -lrdmacm -libverbs || exit 1
cc -Wall -Wextra -Werror -O1 -Iprovider/plugin/tests/c -o "$out/wr_api" provider/plugin/tests/c/wr_api.c -lrdmacm -libverbs -lpthread || exit 1
cc -Wall -Wextra -Werror -O1 -Iprovider/plugin/tests/c -o "$out/cq_events" provider/plugin/tests/c/cq_events.c -lrdmacm -libverbs -lpthread || exit 1
cc -Wall -Wextra -Werror -O1 -Iprovider/plugin/tests/c -o "$out/faults" provider/plugin/tests/c/faults.c -lrdmacm -libverbs -lpthread || exit 1

passed=0 failed=0
pass() { passed=$((passed + 1)); echo "ok    $1"; }
fail() {
    failed=$((failed + 1))
    echo "FAIL  $1"
    for f in "$out/$2".*.log; do
        [[ -f $f ]] || continue
        echo "---- $f (last 15 lines)"
        tail -n 15 "$f"
    done
}

# as USER CMD...: run CMD as USER (root: directly).
as() {
    local user=$1
    shift
    if [[ $user == root ]]; then
        "$@"
    else
        runuser -u "$user" -- "$@"
    fi
}

# single NAME USER PATTERN CMD...: CMD under stag run succeeds and prints PATTERN.
single() {
    local name=$1 user=$2 pattern=$3
    shift 3
    if as "$user" timeout 60 "$STAG" run -- "$@" >"$out/$name.run.log" 2>&1 &&
        grep -Eq "$pattern" "$out/$name.run.log"; then
        pass "$name"
    else
        fail "$name" "$name"
    fi
}

source scripts/lib/common.sh

# pair NAME USER PORT 'SERVER ARGS' 'CLIENT ARGS' [PATTERN]: server then
# client, both under stag run; both must exit 0 (and the client's output
# match PATTERN).
port=21000
pair() {
    local name=$1 user=$2 p=$3 server=$4 client=$5 pattern=${6:-.}
    as "$user" timeout 120 "$STAG" run -- $server >"$out/$name.server.log" 2>&1 &
    local spid=$!
    local ok=1
    wait_port "$p" || ok=0
    if ((ok)); then
        as "$user" timeout 120 "$STAG" run -- $client >"$out/$name.client.log" 2>&1 || ok=0
    fi
    wait "$spid" || ok=0
    if ((ok)) && grep -Eq "$pattern" "$out/$name.client.log"; then
        pass "$name"
    else
        kill "$spid" 2>/dev/null
        fail "$name" "$name"
    fi
}

suite() {
    local user=$1 tag=$2
    single "$tag-ibv_devices" "$user" 'stag0[[:space:]]+0273746167000001' ibv_devices
    single "$tag-ibv_devinfo" "$user" 'PORT_ACTIVE' ibv_devinfo -v -d stag0
    for t in write_lat read_lat send_lat atomic_lat write_bw read_bw send_bw; do
        port=$((port + 1))
        local n=1000
        [[ $t == *_bw ]] && n=200
        pair "$tag-ib_$t" "$user" "$port" "ib_$t -R -d stag0 -p $port -n $n" \
            "ib_$t -R -d stag0 -p $port -n $n 127.0.0.1" '^ *[0-9]'
    done
    # Event mode: completions through stag0's completion channels.
    port=$((port + 1))
    pair "$tag-ib_send_lat-events" "$user" "$port" "ib_send_lat -R -e -d stag0 -p $port -n 500" \
        "ib_send_lat -R -e -d stag0 -p $port -n 500 127.0.0.1" '^ *[0-9]'
    port=$((port + 1))
    pair "$tag-rping" "$user" "$port" "rping -s -a 127.0.0.1 -p $port -C 1000 -V" \
        "rping -c -a 127.0.0.1 -p $port -C 1000 -V -v" 'ping data: rdma-ping-999: ' 
    port=$((port + 1))
    pair "$tag-rdma_server" "$user" "$port" "rdma_server -p $port" \
        "rdma_client -s 127.0.0.1 -p $port" 'rdma_client: end 0'
    port=$((port + 1))
    pair "$tag-rdma_xserver" "$user" "$port" "rdma_xserver -p $port" \
        "rdma_xclient -s 127.0.0.1 -p $port" 'rdma_xclient: end 0'
    port=$((port + 1))
    pair "$tag-fi_pingpong" "$user" "$port" "fi_pingpong -p verbs -e msg -B $port -I 100" \
        "fi_pingpong -p verbs -e msg -P $port -I 100 127.0.0.1" 'bytes'
    single "$tag-verbs_errors" "$user" 'verbs_errors: [1-9][0-9]* passed, 0 failed' "$out/verbs_errors"
    single "$tag-cm_edge" "$user" 'cm_edge: [1-9][0-9]* passed, 0 failed' "$out/cm_edge"
    # conn_param->qp_num, rdma_disconnect before the peer answers (#19).
    single "$tag-cm_gaps" "$user" 'cm_gaps: [1-9][0-9]* passed, 0 failed' "$out/cm_gaps"
    single "$tag-wr_api" "$user" 'wr_api: [1-9][0-9]* passed, 0 failed' "$out/wr_api"
    single "$tag-cq_events" "$user" 'cq_events: [1-9][0-9]* passed, 0 failed' "$out/cq_events"
    # Peer death, teardown with work in flight, SIGPIPE, dereg in flight.
    single "$tag-faults" "$user" 'faults: [1-9][0-9]* passed, 0 failed' "$out/faults"
    single "$tag-stagdv_demo" "$user" 'stagdv_demo: [1-9][0-9]* passed, 0 failed' "$out/stagdv_demo"
}

suite root root
# rdma_resolve_addr to an address nobody answers ARP for (a veth whose peer
# has no address, in a network namespace of its own): ADDR_ERROR with
# -ETIMEDOUT once the call's timeout passes (cm_edge.c resolve-timeout).
if unshare -n bash -c 'ip link set lo up && ip link add v0 type veth peer name v1 &&
        ip addr add 10.77.0.1/24 dev v0 && ip link set v0 up && ip link set v1 up &&
        exec "$0" run -- "$1" resolve-timeout 10.77.0.2' "$STAG" "$out/cm_edge" \
        >"$out/root-cm_resolve_timeout.run.log" 2>&1 &&
    grep -Eq 'cm_edge: [1-9][0-9]* passed, 0 failed' "$out/root-cm_resolve_timeout.run.log"; then
    pass root-cm_resolve_timeout
else
    fail root-cm_resolve_timeout root-cm_resolve_timeout
fi
# rdma_resolve_route when the next hop's neighbour entry went away after
# address resolution and nobody answers ARP: ROUTE_ERROR with -ETIMEDOUT
# once the call's timeout passes (cm_gaps.c route-timeout).
if unshare -n bash -c 'ip link set lo up && ip link add v0 type veth peer name v1 &&
        ip addr add 10.77.0.1/24 dev v0 && ip link set v0 up && ip link set v1 up &&
        ip neigh replace 10.77.0.2 lladdr 02:00:00:00:77:02 dev v0 nud permanent &&
        exec "$0" run -- "$1" route-timeout 10.77.0.2 "ip neigh del 10.77.0.2 dev v0"' \
        "$STAG" "$out/cm_gaps" >"$out/root-cm_route_timeout.run.log" 2>&1 &&
    grep -Eq 'cm_gaps: [1-9][0-9]* passed, 0 failed' "$out/root-cm_route_timeout.run.log"; then
    pass root-cm_route_timeout
else
    fail root-cm_route_timeout root-cm_route_timeout
fi
if ((!QUICK)); then
    id stagtest >/dev/null 2>&1 || useradd --system --no-create-home stagtest
    suite stagtest user

    # stag install: a plain login shell lists stag0 with no wrapper.
    trap '"$STAG" install --uninstall >/dev/null 2>&1' EXIT
    if "$STAG" install >"$out/install.run.log" 2>&1 &&
        env -i HOME=/root PATH=/usr/bin:/bin bash -l -c 'ibv_devices; ibv_devinfo -d stag0' \
            >>"$out/install.run.log" 2>&1 &&
        grep -q 'stag0[[:space:]]*0273746167000001' "$out/install.run.log" &&
        grep -q 'PORT_ACTIVE' "$out/install.run.log"; then
        pass install
    else
        fail install install
    fi
    "$STAG" install --uninstall >"$out/uninstall.run.log" 2>&1
    if ! env -i HOME=/root PATH=/usr/bin:/bin bash -l -c 'ibv_devices' 2>&1 | grep -q stag0; then
        pass uninstall
    else
        fail uninstall uninstall
    fi
fi
echo "rdma-core-apps: $passed passed, $failed failed"
((failed == 0))
