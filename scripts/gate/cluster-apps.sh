#!/usr/bin/env bash
# stag0 across hosts: unmodified Debian programs between network-namespace
# hosts (scripts/cluster/cluster.sh), each workload against a control that does not
# use stag (the same stack over libfabric's tcp;ofi_rxm, or Open MPI's btl
# tcp). Prints `cluster-apps: N passed, M failed`; exits 1 if any failed.
#
#   - libfabric on a host lists the interface's address (not 127.0.0.1)
#     and no FI_SOCKADDR_IB address;
#   - fi_pingpong -p 'verbs;ofi_rxm' -e rdm -S all between two hosts, with
#     FI_OFI_RXM_USE_RNDV_WRITE=0 and =1 and FI_OFI_RXM_USE_SRX=1;
#   - NPopenmpi between two hosts (Open MPI: pml cm, mtl ofi);
#   - scripts/cluster/mpi_check.c on 8 hosts: allreduce, alltoall, a ring up
#     to 4 MiB and one-sided operations, every result checked;
#   - the iSER pair: tgtd (stag run) with a 256 MiB LUN on node1; from node2
#     iscsi-inq, iscsi-perf and scripts/cluster/iscsi_copy writing and
#     reading the whole LUN, checked by sha256 against the input and the
#     target's backing file; iSCSI over TCP from the same tgtd as control;
#     then tgtd stopped as an administrator would (no session left, targets
#     deleted, tgtd exits), which needs stag's TIMEWAIT_EXIT (see tgt_down);
#   - qperf -cm1 between two hosts, the RC tests (qperf's TCP tests as
#     control).
#
# A workload that hangs on stag0 and on its tcp;ofi_rxm control alike is
# reported as upstream (ofiwg/libfabric#7396) and counts as neither.
set -uo pipefail
# Arguments name the parts to run (fi_info iser qperf fi_pingpong netpipe mpi;
# all of them without any).
PARTS=$*
cd "$(dirname "$0")/../.."
ROOT=$PWD
[ "$(id -u)" -eq 0 ] || {
    echo "cluster-apps: needs root (network namespaces)" >&2
    exit 2
}
cargo build --quiet -p stag -p stag-rdma || exit 1
STAG=$ROOT/target/debug/stag
C=$ROOT/scripts/cluster/cluster.sh
# Logs: target/cluster, or target/cluster-PREFIX for another host prefix
# (STAG_CLUSTER_PREFIX, below), so two runs do not remove each other's.
out=$ROOT/target/cluster
[ "${STAG_CLUSTER_PREFIX:-node}" = node ] || out=$out-$STAG_CLUSTER_PREFIX
rm -rf "$out"
mkdir -p "$out"
mpicc -O2 -Wall -Werror -o "$out/mpi_check" scripts/cluster/mpi_check.c || exit 1
cc -O2 -Wall -Werror -o "$out/iscsi_copy" scripts/cluster/iscsi_copy.c -liscsi || exit 1

HOSTS=8
bash "$C" up "$HOSTS" >/dev/null || exit 1
trap 'bash "$C" down >/dev/null 2>&1; rm -rf "${LUN:-}"' EXIT

passed=0 failed=0 upstream=0
pass() {
    passed=$((passed + 1))
    echo "ok    $1"
}
fail() {
    failed=$((failed + 1))
    echo "FAIL  $1 (logs: $out/$1.*)"
}

# Hosts are called node1..nodeN here; STAG_CLUSTER_PREFIX (cluster.sh)
# gives them another prefix, so two runs on one machine do not meet.
P=${STAG_CLUSTER_PREFIX:-node}
export STAG_CLUSTER_PREFIX=$P
on() { # on HOST CMD: CMD (one shell string) on HOST
    bash "$C" exec "${1/#node/$P}" "$2"
}

# verdict NAME RC_STAG RC_CONTROL: a stag0 run that timed out counts as
# upstream when its control timed out too.
verdict() {
    local name=$1 rs=$2 rc=$3
    if ((rs == 0 && rc == 0)); then
        pass "$name"
    elif ((rs == 124 && rc == 124)); then
        upstream=$((upstream + 1))
        echo "UPSTREAM $name: hangs over tcp;ofi_rxm as well (ofiwg/libfabric#7396)"
    else
        fail "$name"
        echo "      stag0 exit $rs, control exit $rc" >&2
    fi
}

# both NAME RC_STAG RC_CONTROL: passes only if both ran clean (tgt and
# libiscsi have no known hang to set a stag0 failure against).
both() {
    if (($2 == 0 && $3 == 0)); then
        pass "$1"
    else
        fail "$1"
        echo "      stag0 exit $2, control exit $3" >&2
    fi
}

# libfabric's view of stag0 on node1: eth0's address, nothing else.
fi_info_check() {
    local log=$out/fi_info.log
    on node1 "$STAG run -- fi_info -p verbs -v" >"$log" 2>&1
    if grep -q 'src_addr: fi_sockaddr_in://10.77.0.1:0' "$log" &&
        ! grep -q '127.0.0.1' "$log" && ! grep -q 'FI_SOCKADDR_IB' "$log" &&
        on node1 "$STAG run -- ibv_devinfo -v" 2>&1 | grep -q 'GID\[ *0\]:.*0273:74ff:fe61:6700'; then
        pass fi_info-addresses
    else
        fail fi_info-addresses
    fi
}

# wait_listen HOST PORT: until a TCP socket on HOST listens on PORT (10 s).
wait_listen() {
    local i
    for i in $(seq 1 100); do
        on "$1" "ss -Hltn 'sport = :$2'" 2>/dev/null | grep -q . && return 0
        sleep 0.1
    done
    return 1
}

# pingpong NAME PROVIDER USE_STAG ENV PORT: server on node1, client on
# node2; prints the client's exit status (124: timed out).
pingpong() {
    local name=$1 prov=$2 wrap=$3 env=$4 port=$5 rc=0
    local run="env $env FI_PROVIDER='$prov' $wrap fi_pingpong -p '$prov' -e rdm -S all -I 20"
    on node1 "timeout 120 $run -B $port" >"$out/$name.server.log" 2>&1 &
    local spid=$!
    wait_listen node1 "$port"
    on node2 "timeout 120 $run -P $port 10.77.0.1" >"$out/$name.client.log" 2>&1 || rc=$?
    wait "$spid" || ((rc)) || rc=$?
    # Every size of -S all (64 B to 6 MiB) went through.
    if ((rc == 0)) && ! grep -Eq '^6m +20 +=20 ' "$out/$name.client.log"; then
        rc=1
    fi
    echo "$rc"
}

fi_pingpong_checks() {
    local port=9300 mode tag rs rc
    for mode in FI_OFI_RXM_USE_RNDV_WRITE=0 FI_OFI_RXM_USE_RNDV_WRITE=1 FI_OFI_RXM_USE_SRX=1; do
        tag=${mode#FI_OFI_RXM_USE_}
        tag=${tag,,}
        rs=$(pingpong "fi_pingpong-$tag" 'verbs;ofi_rxm' "$STAG run --" "$mode" "$port")
        rc=$(pingpong "fi_pingpong-$tag-control" 'tcp;ofi_rxm' "" "$mode" $((port + 1)))
        port=$((port + 2))
        verdict "fi_pingpong-rdm-$tag" "$rs" "$rc"
    done
}

MPIRUN="mpirun --mca plm_rsh_agent '$C exec' --mca plm_rsh_no_tree_spawn 1 \
--mca oob_tcp_if_include 10.77.0.0/24 --mca btl_tcp_if_include 10.77.0.0/24"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI over libfabric (pml cm, mtl ofi) with PROVIDER.
mpi_ofi() {
    echo "env FI_PROVIDER='$1' $2 $MPIRUN --mca pml cm --mca mtl ofi \
--mca mtl_ofi_provider_include '$1' --mca btl ^openib -x FI_PROVIDER"
}
MPI_STAG=$(mpi_ofi 'verbs;ofi_rxm' "$STAG run --")
MPI_OFI_TCP=$(mpi_ofi 'tcp;ofi_rxm' "")
MPI_BTL_TCP="$MPIRUN --mca pml ob1 --mca btl tcp,self"

# mpi NAME HOSTS 'MPIRUN…' PROGRAM PATTERN: prints the exit status.
mpi() {
    local name=$1 hosts=$2 launcher=$3 prog=$4 pattern=$5 rc=0 list
    list=$(seq -s, -f "$P%g" 1 "$hosts")
    on node1 "timeout 150 $launcher --host $list -np $hosts $prog" >"$out/$name.log" 2>&1 || rc=$?
    if ((rc == 0)) && ! grep -Eq "$pattern" "$out/$name.log"; then
        rc=1
    fi
    echo "$rc"
}

netpipe_checks() {
    # -p 0: no perturbed sizes around each power of two (a third of the
    # points; the 1 MiB check is the same).
    local np="NPopenmpi -p 0 -u 1048576 -o"
    local p='^ *1048576 +[0-9.]+ +[0-9.]+' rs rc rb
    rs=$(mpi netpipe-stag 2 "$MPI_STAG" "$np $out/np-stag.out" '.')
    grep -Eq "$p" "$out/np-stag.out" 2>/dev/null || ((rs)) || rs=1
    rc=$(mpi netpipe-ofi-tcp 2 "$MPI_OFI_TCP" "$np $out/np-ofi-tcp.out" '.')
    grep -Eq "$p" "$out/np-ofi-tcp.out" 2>/dev/null || ((rc)) || rc=1
    rb=$(mpi netpipe-btl-tcp 2 "$MPI_BTL_TCP" "$np $out/np-btl-tcp.out" '.')
    grep -Eq "$p" "$out/np-btl-tcp.out" 2>/dev/null || ((rb)) || rb=1
    ((rb == 0)) || echo "      control btl tcp failed (exit $rb)" >&2
    verdict netpipe-2-hosts "$rs" "$rc"
}

mpi_checks() {
    local ok='^mpi-check: ok \(8 ranks' rs rc rb
    # One-sided through osc pt2pt over the pml (Open MPI 4.1's only
    # one-sided component without an RDMA btl).
    rs=$(mpi mpi_check-stag "$HOSTS" "$MPI_STAG --mca osc pt2pt" "$out/mpi_check --rma" "$ok")
    rc=$(mpi mpi_check-ofi-tcp "$HOSTS" "$MPI_OFI_TCP --mca osc pt2pt" "$out/mpi_check --rma" "$ok")
    rb=$(mpi mpi_check-btl-tcp "$HOSTS" "$MPI_BTL_TCP --mca osc pt2pt" "$out/mpi_check --rma" "$ok")
    ((rb == 0)) || echo "      control btl tcp failed (exit $rb)" >&2
    verdict "mpi_check-$HOSTS-hosts" "$rs" "$rc"
}

# The iSER pair: tgtd on node1 under stag run, one 256 MiB file-backed
# LUN exported twice from the same tgtd: target IQN:iser (lld iser, on
# stag0's rdma_cm port 3260) and IQN:tcp (lld iscsi, TCP portal 3261, the
# control). tgt binds a target to one transport, and admits an iSER login
# only if both an address ACL and an initiator-name ACL match (TCP: either).
IQN=iqn.2026-11.org.stag
INITIATOR=$IQN:client
ISER_URL=iser://10.77.0.1/$IQN:iser/1
TCP_URL=iscsi://10.77.0.1:3261/$IQN:tcp/1
# tgtd's management socket and lock are files shared by every namespace.
TGT_PORT=$((20000 + $$ % 10000))
LUN=$(mktemp -d /dev/shm/stag-cluster-lun.XXXXXX)
TGTD_PID=
tgt_up() {
    truncate -s 256M "$LUN/lun.img"
    on node1 "echo \$\$ >$LUN/stag-run.pid; exec env STAG_CM_TIMEWAIT_EXIT=1 $STAG run -- \
        tgtd -f -C $TGT_PORT --iscsi portal=10.77.0.1:3261" >"$out/tgtd.log" 2>&1 &
    TGTD_PID=$!
    local t="tgtadm -C $TGT_PORT" i
    for i in $(seq 1 100); do
        on node1 "$t --op show --mode sys" >/dev/null 2>&1 && break
        sleep 0.1
    done
    on node1 "$t --lld iser --op new --mode target --tid 1 -T $IQN:iser &&
        $t --lld iser --op new --mode logicalunit --tid 1 --lun 1 -b $LUN/lun.img &&
        $t --lld iser --op bind --mode target --tid 1 -I ALL &&
        $t --lld iser --op bind --mode target --tid 1 -Q $INITIATOR &&
        $t --lld iscsi --op new --mode target --tid 2 -T $IQN:tcp &&
        $t --lld iscsi --op new --mode logicalunit --tid 2 --lun 1 -b $LUN/lun.img &&
        $t --lld iscsi --op bind --mode target --tid 2 -I ALL" >"$out/tgtadm.log" 2>&1 &&
        wait_listen node1 3260 && wait_listen node1 3261
}
# tgt_down: stops tgtd the way an administrator does, and fails if it
# cannot: every initiator has left, so no session (I_T nexus) may remain;
# the targets are deleted without --force and tgtd leaves on
# `--op delete --mode system`. tgt frees an iSER connection only on
# RDMA_CM_EVENT_TIMEWAIT_EXIT, which the kernel raises only on IB/RoCE
# and stag0 only when asked (STAG_CM_TIMEWAIT_EXIT=1, set above); without
# it the iSER session lingers, the delete answers "this target is still
# active", and (with --force) tgtd crashes in its iSER transport's NULL
# ep_close. A tgtd still there after that is killed, and this fails.
tgt_down() {
    local rc=0 pid i t="tgtadm -C $TGT_PORT"
    [ -n "$TGTD_PID" ] || return 0
    on node1 "$t --op show --mode target" >"$out/tgt-final.log" 2>&1 || rc=1
    grep -q "Target 1: $IQN:iser" "$out/tgt-final.log" || rc=1
    # The last initiator's DISCONNECTED and TIMEWAIT_EXIT may still be on
    # their way to tgtd's event loop: its sessions end within 10 s.
    for i in $(seq 1 100); do
        on node1 "$t --op show --mode target" >"$out/tgt-sessions.log" 2>&1 || break
        grep -q 'I_T nexus: ' "$out/tgt-sessions.log" || break
        sleep 0.1
    done
    grep -q 'I_T nexus: ' "$out/tgt-sessions.log" && {
        echo "      tgtd kept a session after every initiator left" >&2
        rc=1
    }
    on node1 "$t --op delete --mode target --tid 1 && $t --op delete --mode target --tid 2 &&
        $t --op delete --mode system" >"$out/tgt-stop.log" 2>&1 || rc=1
    for i in $(seq 1 100); do
        kill -0 "$TGTD_PID" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$TGTD_PID" 2>/dev/null; then
        echo "      tgtd did not leave on --op delete --mode system; killed" >&2
        rc=1
        # tgtd is the child of the `stag run` that wrote its pid.
        pid=$(pgrep -P "$(cat "$LUN/stag-run.pid")" -x tgtd)
        [ -n "$pid" ] && kill -KILL "$pid"
    fi
    wait "$TGTD_PID" || rc=1
    TGTD_PID=
    return "$rc"
}

# iscsi_run NAME WRAP URL: iscsi-inq, then iscsi-perf for 3 s, from node2;
# prints the exit status.
iscsi_run() {
    local name=$1 wrap=$2 url=$3 rc=0
    on node2 "timeout 30 $wrap iscsi-inq -i $INITIATOR $url" >"$out/$name.inq.log" 2>&1 || rc=$?
    ((rc == 0)) && { grep -q 'Product:VIRTUAL-DISK' "$out/$name.inq.log" || rc=1; }
    ((rc == 0)) || {
        echo "$rc"
        return
    }
    # iscsi-perf reads until SIGINT, then prints its averages and
    # "finished."; a second SIGINT aborts it. So exactly one, to
    # iscsi-perf itself (the child of `stag run`, or the job itself):
    # timeout would signal the command and its process group both.
    # One that has not finished 20 s later is a hang (KILL, 137).
    timeout -s KILL 20 bash "$C" exec "${P}2" "$wrap iscsi-perf -i $INITIATOR $url & job=\$!;
        sleep 3; pkill -INT -P \$job -x iscsi-perf || kill -INT \$job; wait \$job" \
        >"$out/$name.perf.log" 2>&1 || rc=$?
    tr '\r' '\n' <"$out/$name.perf.log" | grep -Eq 'iops average [1-9][0-9]* ' || ((rc)) || rc=1
    tr '\r' '\n' <"$out/$name.perf.log" | grep -q '^finished' || ((rc)) || rc=1
    echo "$rc"
}

# copy NAME WRAP read|write URL FILE: the whole LUN from or to FILE.
copy() {
    local name=$1 wrap=$2 dir=$3 url=$4 file=$5 rc=0 t0=$SECONDS
    if [ "$dir" = write ]; then
        on node2 "timeout 90 $wrap $out/iscsi_copy -i $INITIATOR write $url < $file" \
            >"$out/$name.log" 2>&1 || rc=$?
    else
        on node2 "timeout 90 $wrap $out/iscsi_copy -i $INITIATOR read $url > $file" \
            >"$out/$name.log" 2>&1 || rc=$?
    fi
    # How close a pass came to the timeout, and how a failure ended.
    echo "copy: exit $rc after $((SECONDS - t0)) s (limit 90)" >>"$out/$name.log"
    echo "$rc"
}

# same_sum FILE…: whether they all have one sha256 (says which differ).
same_sum() {
    local sums
    sums=$(sha256sum "$@")
    [ "$(awk '{print $1}' <<<"$sums" | sort -u | wc -l)" = 1 ] && return 0
    echo "      sha256 differ:" >&2
    sed 's/^/        /' <<<"$sums" >&2
    return 1
}

iser_checks() {
    local rs rc
    if ! tgt_up; then
        fail iser-tgtd
        tgt_down
        return
    fi
    rs=$(iscsi_run iser-inq-perf "$STAG run --" "$ISER_URL")
    rc=$(iscsi_run iscsi-tcp-inq-perf "" "$TCP_URL")
    both iser-inq-perf "$rs" "$rc"

    # Every byte of the LUN written and read back, each checked against
    # what went in and what the target's backing file holds: TCP writes A
    # (the control), iSER overwrites it with B, iSER reads B, TCP reads B.
    local a=$LUN/a b=$LUN/b back=$LUN/back ctl=$LUN/ctl
    head -c 256M /dev/urandom >"$a"
    head -c 256M /dev/urandom >"$b"
    rc=$(copy iscsi-tcp-write "" write "$TCP_URL" "$a")
    ((rc == 0)) && { same_sum "$a" "$LUN/lun.img" || rc=1; }
    rs=$(copy iser-write "$STAG run --" write "$ISER_URL" "$b")
    ((rs == 0)) && { same_sum "$b" "$LUN/lun.img" || rs=1; }
    if ((rs == 0)); then
        rs=$(copy iser-read "$STAG run --" read "$ISER_URL" "$back")
        ((rs == 0)) && { same_sum "$b" "$back" || rs=1; }
    fi
    if ((rc == 0)); then
        rc=$(copy iscsi-tcp-read "" read "$TCP_URL" "$ctl")
        ((rc == 0)) && { same_sum "$b" "$ctl" || rc=1; }
    fi
    both iser-256MiB-verified "$rs" "$rc"
    if tgt_down; then pass iser-tgtd; else fail iser-tgtd; fi
}

# qperf -cm1 (rdma_cm) between two hosts, the RC tests, against qperf's
# own TCP tests between the same hosts as control. Each test must print
# its figure (a bandwidth, latency or message rate). In rc_bw, rc_bi_bw
# and rc_rdma_write_bw the sender outruns the Receives the server
# re-posts: on stag0 those messages wait for their Receives (#19).
QPERF_RC="rc_lat rc_rdma_read_bw rc_rdma_read_lat \
rc_rdma_write_lat rc_rdma_write_poll_lat rc_compare_swap_mr rc_fetch_add_mr \
rc_bw rc_bi_bw rc_rdma_write_bw"
qperf_run() { # NAME WRAP PORT OPTIONS TESTS…: prints the client's exit status
    local name=$1 wrap=$2 port=$3 opts=$4 rc=0 pidfile=$out/$1.server.pid
    shift 4
    on node1 "echo \$\$ >$pidfile; exec timeout 150 $wrap qperf -lp $port" \
        >"$out/$name.server.log" 2>&1 &
    local spid=$!
    wait_listen node1 "$port"
    on node2 "timeout 120 $wrap qperf -lp $port $opts -t 1 10.77.0.1 $*" \
        >"$out/$name.client.log" 2>&1 || rc=$?
    # The server's timeout passes TERM on to qperf (and stag run).
    kill -TERM "$(cat "$pidfile")" 2>/dev/null
    wait "$spid" 2>/dev/null
    local t
    for t in "$@"; do
        grep -A1 -x "$t:" "$out/$name.client.log" | grep -Eq '= +[0-9.]+ [KMG]?[a-zA-Z/]+' ||
            ((rc)) || rc=1
    done
    echo "$rc"
}
qperf_checks() {
    local rs rc
    # shellcheck disable=SC2086
    rs=$(qperf_run qperf-rc "$STAG run --" 19950 -cm1 $QPERF_RC)
    rc=$(qperf_run qperf-tcp-control "" 19951 "" tcp_bw tcp_lat)
    both qperf-cm1-rc "$rs" "$rc"
}

for part in ${PARTS:-fi_info iser qperf fi_pingpong netpipe mpi}; do
    case $part in
    fi_info) fi_info_check ;;
    iser) iser_checks ;;
    qperf) qperf_checks ;;
    fi_pingpong) fi_pingpong_checks ;;
    netpipe) netpipe_checks ;;
    mpi) mpi_checks ;;
    esac
done

((upstream == 0)) || echo "cluster-apps: $upstream upstream (hang with tcp;ofi_rxm too, not counted)"
echo "cluster-apps: $passed passed, $failed failed"
((failed == 0))
