#!/bin/busybox sh
# shellcheck shell=sh
# /init of the stag test VM (runs as PID 1 under busybox, see scripts/vm/vm.sh).
#
# Boot flow:
#   1. load the kernel modules listed in /lib/modules/order (host-resolved
#      dependency order, so no modprobe/modules.dep is needed in here);
#   2. mount the host's / read-only over virtio-9p with a tmpfs overlay on top
#      and chroot into it, so host-built binaries and the host's rdma-core run
#      unchanged at the same absolute paths;
#   3. create rxe0 and siw0, each on its own dummy netdev;
#   4. run the command that vm.sh left in the control share, with its stdout
#      on ttyS1 and stderr on ttyS2 (both wired to the host's stdout/stderr);
#   5. report its exit code (file in the control share + console marker) and
#      power off.
#
# Console (ttyS0) lines starting with "stag-vm:" are this script talking.  A
# failure of the harness itself is reported as STAG_VM_FAIL=<reason> and never
# as an exit code, so the host cannot mistake it for the command's result.

export PATH=/bin:/sbin
/bin/busybox --install -s /bin

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

log() { echo "stag-vm: $*" >/dev/ttyS0; }
fail() {
    log "$*"
    echo "STAG_VM_FAIL=$*" >/dev/ttyS0
    [ -d /ctl/. ] && echo "$*" >/ctl/fail 2>/dev/null
    sync
    poweroff -f
    reboot -f
}

# 1. Modules. Lines: "<file> req|opt [params...]". An optional module (e.g.
# crc32c-intel, which needs SSE4.2) may fail to load; a required one may not.
while read -r file need params; do
    [ -n "$file" ] || continue
    # shellcheck disable=SC2086 # params are intentionally split
    if ! insmod "/lib/modules/$file" $params 2>/tmp/insmod.err; then
        if grep -q 'File exists' /tmp/insmod.err; then continue; fi
        [ "$need" = req ] && fail "insmod $file: $(cat /tmp/insmod.err)"
        log "optional module $file not loaded: $(cat /tmp/insmod.err)"
    fi
done </lib/modules/order

# 2. Control share (rw, host temp dir): env.sh, cmd.sh, and where rc goes.
mkdir -p /ctl /host /rw /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 stagctl /ctl ||
    fail "cannot mount the control share"
# env.sh is written by vm.sh: STAG_VM_SHARES, STAG_RXE_ADDR, STAG_SIW_ADDR, ...
# shellcheck source=/dev/null
. /ctl/env.sh

# The host's / (read-only). cache=loose: the guest never writes it and the host
# is not expected to change it under a running test, and it makes repeated
# reads (exec, shared libraries) far cheaper than uncached 9p under TCG.
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /host ||
    fail "cannot mount the host root over 9p"
mount -t tmpfs -o mode=0755 tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work /newroot ||
    fail "cannot mount the overlay root"
R=/newroot
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
mount -t tmpfs -o mode=0755 tmpfs $R/run
# Writable shares (--share DIR): tag "share<i>", same absolute path as on host.
i=0
for dir in $STAG_VM_SHARES; do
    mkdir -p "$R$dir"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 "share$i" "$R$dir" ||
        fail "cannot mount share $dir"
    i=$((i + 1))
done

# 3. RDMA devices. rdma_cm refuses 127.0.0.1 for both rxe and siw, and siw only
# listens on its netdev's address, hence one dummy netdev + address per device.
# busybox's ip does the netdevs (no 9p round trips); the rdma tool is the
# host's (iproute2), run in the chroot.
ip link set lo up || fail "ip link set lo up"
setup_dev() { # <netdev> <addr> <rdma dev> <type>
    ip link add "$1" type dummy || fail "ip link add $1 type dummy"
    ip addr add "$2/24" dev "$1" || fail "ip addr add $2 dev $1"
    ip link set "$1" up || fail "ip link set $1 up"
    chroot $R rdma link add "$3" type "$4" netdev "$1" || fail "rdma link add $3 type $4"
}
setup_dev dummy0 "$STAG_RXE_ADDR" rxe0 rxe
setup_dev dummy1 "$STAG_SIW_ADDR" siw0 siw
if [ ! -e $R/dev/infiniband/uverbs0 ] || [ ! -e $R/dev/infiniband/uverbs1 ]; then
    fail "no /dev/infiniband/uverbs0 and uverbs1"
fi
# The CPUs vm.sh kept offline for the boot (maxcpus=1, see there) come up
# now, once the kernel has done its boot-time code patching.
for cpu in /sys/devices/system/cpu/cpu[0-9]*; do
    [ -f "$cpu/online" ] || continue
    if [ "$(cat "$cpu/online")" = 0 ]; then
        echo 1 >"$cpu/online" || fail "cannot bring ${cpu##*/} online"
    fi
done
read -r up _ </proc/uptime
log "ready after ${up}s (kernel $(uname -r), $(grep -c '^processor' /proc/cpuinfo) CPUs)"
echo "$up" >/ctl/ready

# 4. The command. Raw ttys: no \n -> \r\n rewriting on the way to the host.
stty -F /dev/ttyS1 raw -echo
stty -F /dev/ttyS2 raw -echo
cp /ctl/cmd.sh $R/run/stag-vm-cmd.sh
# The command sees a terminal only where vm.sh's own stdout/stderr is one;
# otherwise (CI, pipes, files) it writes into a pipe, so that tools do not
# colour or animate their output. STAG_VM_TTY_OUT/ERR come from env.sh.
pids=
out=/dev/ttyS1 err=/dev/ttyS2
if [ "$STAG_VM_TTY_OUT" != 1 ]; then
    mkfifo /tmp/out
    cat /tmp/out >/dev/ttyS1 &
    pids="$pids $!" out=/tmp/out
fi
if [ "$STAG_VM_TTY_ERR" != 1 ]; then
    mkfifo /tmp/err
    cat /tmp/err >/dev/ttyS2 &
    pids="$pids $!" err=/tmp/err
fi
chroot $R /usr/bin/env -i /bin/bash /run/stag-vm-cmd.sh </dev/null >$out 2>$err
rc=$?
if [ -n "$pids" ]; then
    # The copies end once every writer is gone; a daemon the command left
    # behind may hold the pipe open, so give up on it after 3 s.
    # shellcheck disable=SC2086 # $pids is a list
    (sleep 3; kill $pids) 2>/dev/null &
    timer=$!
    # shellcheck disable=SC2086
    wait $pids
    kill $timer 2>/dev/null
fi

# 5. Report. The last close of ttyS1/ttyS2 (when the command exited) waited
# for the UARTs to drain, so all output has reached the host by now.
read -r up _ </proc/uptime
log "command exited with $rc after ${up}s"
echo "$rc" >/ctl/rc
echo "STAG_VM_EXIT=$rc" >/dev/ttyS0
sync
poweroff -f
reboot -f
