#!/usr/bin/env bash
# A cluster of network-namespace hosts on this machine, for running stag0
# across hosts (MPI, libfabric, iSER) without a second machine.
#
#   scripts/cluster/cluster.sh up N            N hosts (1..16): node1..nodeN
#   scripts/cluster/cluster.sh down            remove every host and the bridge
#   scripts/cluster/cluster.sh exec HOST CMD…  run CMD on HOST (as ssh HOST CMD would)
#   scripts/cluster/cluster.sh hosts           the host names, one a line
#
# Host nodeI is the network namespace nodeI, whose eth0 has 10.77.0.I/24 (a
# veth whose other end sits on a bridge), loopback up, IPv6 off, and its
# own /etc/hosts (/etc/netns/nodeI/hosts, which `ip netns exec` binds over
# /etc/hosts) naming every host. The bridge lives in a namespace of its own
# (nodebr), so the host's own namespace gets no address, no route and no
# traffic: everything stays inside the namespaces made here.
#
# `exec` is the launcher Open MPI takes as `--mca plm_rsh_agent`: it is
# called like ssh (HOST, then the words of a shell command) and runs the
# command in HOST's namespace and a UTS namespace whose hostname is HOST.
# The environment passes through, as `ssh -o SendEnv` would send it;
# with STAG_CLUSTER_SSH_ENV=1 it does not: the command starts with what a
# plain ssh session has (PATH, HOME, USER, LOGNAME, SHELL, LANG and
# /etc/environment, as pam_env reads it), to try what a real cluster's
# ssh launcher would pass on.
#
# `up` is idempotent: it first removes what an earlier `up` left.
set -euo pipefail

PREFIX=${STAG_CLUSTER_PREFIX:-node}
BRIDGE_NS=${PREFIX}br
SUBNET=10.77.0
MAX=16

die() {
    echo "cluster.sh: $*" >&2
    exit 2
}

# The hosts that exist now (namespaces named PREFIX<number>).
existing() {
    ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+$" | sort -V || true
}

down() {
    local h
    for h in $(existing); do
        ip netns pids "$h" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$h" 2>/dev/null || true
        rm -rf "/etc/netns/$h"
    done
    if ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$BRIDGE_NS"; then
        ip netns del "$BRIDGE_NS"
    fi
}

up() {
    local n=$1 i h
    [[ $n =~ ^[0-9]+$ ]] && ((n >= 1 && n <= MAX)) || die "up N: N from 1 to $MAX"
    [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces)"
    down
    ip netns add "$BRIDGE_NS"
    ip -n "$BRIDGE_NS" link set lo up
    ip -n "$BRIDGE_NS" link add br0 type bridge
    ip -n "$BRIDGE_NS" link set br0 up
    local hosts="127.0.0.1 localhost"$'\n'
    for ((i = 1; i <= n; i++)); do
        hosts+="$SUBNET.$i ${PREFIX}$i"$'\n'
    done
    for ((i = 1; i <= n; i++)); do
        h=${PREFIX}$i
        ip netns add "$h"
        ip netns exec "$h" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 \
            net.ipv6.conf.default.disable_ipv6=1
        ip link add eth0 netns "$h" type veth peer name "v$i" netns "$BRIDGE_NS"
        ip -n "$BRIDGE_NS" link set "v$i" master br0 up
        ip -n "$h" link set lo up
        ip -n "$h" addr add "$SUBNET.$i/24" dev eth0
        ip -n "$h" link set eth0 up
        mkdir -p "/etc/netns/$h"
        printf '%s' "$hosts" >"/etc/netns/$h/hosts"
        echo "$h" >"/etc/netns/$h/hostname"
    done
    # Every host reaches every other before anyone relies on it (a veth
    # on a fresh bridge forwards once the port leaves its learning state).
    for ((i = 1; i <= n; i++)); do
        local ok=0 t
        for t in $(seq 1 50); do
            if ip netns exec "${PREFIX}1" ping -c1 -W1 -q "$SUBNET.$i" >/dev/null 2>&1; then
                ok=1
                break
            fi
            sleep 0.1
        done
        ((ok)) || die "${PREFIX}1 cannot reach $SUBNET.$i"
    done
    echo "cluster: $n hosts up (${PREFIX}1..${PREFIX}$n, $SUBNET.1-$n)"
}

# exec HOST WORDS…: the words are one shell command, as ssh joins them.
run_on() {
    local h=$1
    shift
    [[ $h =~ ^${PREFIX}[0-9]+$ ]] || h=$(resolve "$h")
    ip netns list | awk '{print $1}' | grep -qx "$h" || die "no host $h (scripts/cluster/cluster.sh up N)"
    if [ "${STAG_CLUSTER_SSH_ENV:-0}" = 1 ]; then
        exec ip netns exec "$h" unshare --uts env -i \
            PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            HOME="${HOME:-/root}" USER="$(id -un)" LOGNAME="$(id -un)" SHELL=/bin/sh \
            LANG="${LANG:-C.UTF-8}" STAG_CLUSTER_SSH_ENV=1 STAG_CLUSTER_PREFIX="$PREFIX" \
            sh -c "hostname $h; set -a; [ -r /etc/environment ] && . /etc/environment; set +a; $*"
    fi
    exec ip netns exec "$h" unshare --uts sh -c "hostname $h; $*"
}

# A host given by address (10.77.0.I) names nodeI.
resolve() {
    case $1 in
    "$SUBNET".*) echo "${PREFIX}${1##*.}" ;;
    *) echo "$1" ;;
    esac
}

case ${1:-} in
up) up "${2:-}" ;;
down) down && echo "cluster: down" ;;
exec)
    [ $# -ge 3 ] || die "exec HOST CMD…"
    shift
    # Open MPI's rsh launcher may put ssh options first; none apply here.
    while [[ ${1:-} == -* ]]; do shift; done
    run_on "$@"
    ;;
hosts) existing ;;
*) die "usage: cluster.sh up N | down | exec HOST CMD… | hosts" ;;
esac
