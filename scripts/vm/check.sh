#!/usr/bin/env bash
# Smoke test of the VM's RDMA devices; run inside the VM by `scripts/vm/vm.sh
# --check`. Lists the devices, dumps their capabilities, and moves real data on
# each of rxe0 and siw0 with perftest (server and client both in the VM, over
# rdma_cm on the device's own address). Exits non-zero if anything failed.
set -uo pipefail

: "${STAG_IN_VM:?run this through scripts/vm/vm.sh --check}"
RXE_DEV=${STAG_RXE_DEV:-rxe0} RXE_ADDR=${STAG_RXE_ADDR:?}
SIW_DEV=${STAG_SIW_DEV:-siw0} SIW_ADDR=${STAG_SIW_ADDR:?}
failed=()
passed=()

step() { printf '\n=== %s\n' "$*"; }
t_start=${EPOCHREALTIME/./}
elapsed() { local d=$((${EPOCHREALTIME/./} - $1)); printf '%d.%02ds' $((d / 1000000)) $((d % 1000000 / 10000)); }

step "kernel $(uname -r)"
step "rdma link"
rdma link show || failed+=("rdma link")
step "ibv_devices"
ibv_devices || failed+=(ibv_devices)
for dev in "$RXE_DEV" "$SIW_DEV"; do
    step "ibv_devinfo -v -d $dev"
    if ! ibv_devinfo -v -d "$dev" | tee "/tmp/devinfo-$dev"; then
        failed+=("ibv_devinfo $dev")
    fi
done

# rdma-core 44's ibv_devinfo prints the newer capability bits as "Unknown
# flags"; name the ones stag cares about (kernel uapi ib_user_verbs.h).
step "device_cap_flags_ex, decoded"
for dev in "$RXE_DEV" "$SIW_DEV"; do
    ex=$(sed -n 's/.*device_cap_flags_ex:[[:space:]]*\(0x[0-9A-Fa-f]*\).*/\1/p' "/tmp/devinfo-$dev")
    names=()
    if [[ -n $ex ]]; then
        (((ex >> 38) & 1)) && names+=(FLUSH_GLOBAL)
        (((ex >> 39) & 1)) && names+=(FLUSH_PERSISTENT)
        (((ex >> 40) & 1)) && names+=(ATOMIC_WRITE)
    fi
    echo "$dev: device_cap_flags_ex=${ex:-?} (bits 38-40: ${names[*]:-none of FLUSH_GLOBAL FLUSH_PERSISTENT ATOMIC_WRITE})"
done

# Waits until <tool> has an rdma_cm id listening on <port>: a client that
# connects earlier is rejected, and perftest does not recover from that.
wait_listen() { # <server pid> <tool> <port>
    local tries=100
    while ((tries--)); do
        rdma res show cm_id 2>/dev/null | grep -q "state LISTEN .* comm $2 .*:$3 " && return 0
        kill -0 "$1" 2>/dev/null || return 1
        sleep 0.2
    done
    return 1
}

# One perftest run: server in the background, client against the device's
# address once the server listens.
perf() { # <tool> <dev> <addr> <port> [extra args...]
    local tool=$1 dev=$2 addr=$3 port=$4 t0 rc=1
    shift 4
    command -v "$tool" >/dev/null || { echo "$tool: not installed (perftest)"; failed+=("$tool $dev"); return; }
    step "$tool -d $dev -R $* (server + client on $addr)"
    t0=${EPOCHREALTIME/./}
    timeout 90 "$tool" -d "$dev" -R -p "$port" "$@" >"/tmp/$tool-$dev.server" 2>&1 &
    local spid=$!
    if wait_listen "$spid" "$tool" "$port"; then
        timeout 60 "$tool" -d "$dev" -R -p "$port" "$@" "$addr"
        rc=$?
    else
        echo "server did not start listening on port $port"
    fi
    ((rc == 0)) || kill "$spid" 2>/dev/null
    wait "$spid"
    local src=$?
    if ((rc == 0 && src == 0)); then
        passed+=("$tool $dev ($(elapsed "$t0"))")
    else
        echo "--- server output:"
        cat "/tmp/$tool-$dev.server"
        failed+=("$tool $dev (client $rc, server $src)")
    fi
}

perf ib_write_lat "$RXE_DEV" "$RXE_ADDR" 18515 -n 1000
perf ib_write_bw "$RXE_DEV" "$RXE_ADDR" 18516 -n 1000 -s 65536
perf ib_atomic_lat "$RXE_DEV" "$RXE_ADDR" 18517 -n 1000
perf ib_write_lat "$SIW_DEV" "$SIW_ADDR" 18518 -n 1000
perf ib_write_bw "$SIW_DEV" "$SIW_ADDR" 18519 -n 1000 -s 65536
perf ib_read_lat "$SIW_DEV" "$SIW_ADDR" 18520 -n 1000

step "summary ($(elapsed "$t_start") in the VM)"
for p in "${passed[@]}"; do echo "PASS $p"; done
for f in "${failed[@]}"; do echo "FAIL $f"; done
echo "${#passed[@]} passed, ${#failed[@]} failed"
((${#failed[@]} == 0))
