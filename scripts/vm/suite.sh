#!/usr/bin/env bash
# The guest side of scripts/vm/vm-suite.sh: runs in the VM (vm.sh), cwd = the
# project. Arguments: OUTDIR NAME=EXECUTABLE... ; writes "passed failed" to
# OUTDIR/counts.
set -uo pipefail
out=$1
shift
passed=0 failed=0
failures=()
: "${STAG_RXE_DEV:?not inside vm.sh}"
# Set by vm-suite.sh: where stag and the examples were built, which
# rdma-core release they run on, and (for a private build) its lib/.
bin=${STAG_SUITE_BIN:-target/debug}
rdma_core=${STAG_RDMA_CORE:-44}
# The soak loops of the test binaries (verbs/tests/common soak()) go round a
# fifth as often: a message on a kernel device under TCG costs milliseconds.
export STAG_SOAK_DIVISOR=${STAG_SOAK_DIVISOR:-5}
if [[ -n ${STAG_RDMA_LIB:-} ]]; then
    export LD_LIBRARY_PATH=$STAG_RDMA_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

# One test executable: count its tests from libtest's summary line; a
# crash or timeout without one counts as one failure.
run_tests() { # label exe args...
    local label=$1 exe=$2 log rc p f t0 took
    shift 2
    log=$(mktemp)
    t0=$(date +%s%N)
    timeout 300 "$exe" --test-threads=1 "$@" >"$log" 2>&1
    rc=$?
    took=$(tenths_since "$t0")
    p=$(sed -n 's/^test result: .* \([0-9]*\) passed; \([0-9]*\) failed.*/\1/p' "$log" | tail -n1)
    f=$(sed -n 's/^test result: .* \([0-9]*\) passed; \([0-9]*\) failed.*/\2/p' "$log" | tail -n1)
    if [[ -z $p ]]; then
        p=0 f=1
    elif ((rc != 0 && f == 0)); then
        f=1
    fi
    passed=$((passed + p)) failed=$((failed + f))
    printf '  %-28s %3d passed, %d failed (%s)%s\n' "$label" "$p" "$f" "$took" "$( ((rc == 124)) && echo ' (TIMEOUT)')"
    if ((f)); then
        failures+=("$label")
        grep -E '^test .*FAILED|panicked|^  (left|right):|^[a-z].*Error|^called' "$log" | head -n 40 | sed 's/^/      /'
    fi
    rm -f "$log"
}

one() { # label: a single check that passed (0) or not, [what it took]
    local label=$1 ok=$2 took=${3:+ ($3)}
    if ((ok == 0)); then
        passed=$((passed + 1))
        printf '  %-28s ok%s\n' "$label" "$took"
    else
        failed=$((failed + 1))
        failures+=("$label")
        printf '  %-28s FAILED%s\n' "$label" "$took"
    fi
}

# tenths_since T0: tenths of a second since T0 (date +%s%N), as "S.T s".
tenths_since() {
    local t=$((($(date +%s%N) - $1) / 100000000))
    echo "$((t / 10)).$((t % 10)) s"
}

# Expected rows of the capability matrix, per device and kernel.
check_caps() { # dev kind(rxe|siw) matrix-file
    local dev=$1 kind=$2 m=$3 ok=0 row
    row() { sed -n "/^$dev /,/^[^ ]/p" "$m" | grep -E "^  $1 " | head -n1; }
    expect() { # op regex
        local r
        r=$(row "$1")
        if ! grep -qE "$2" <<<"$r"; then
            echo "      $dev $1: expected /$2/, got: ${r:-<missing>}"
            ok=1
        fi
    }
    if [[ $kind == rxe ]]; then
        expect '\(posts with\)' 'ibv_wr_\* \(ibv_create_qp_ex send_ops_flags\)$'
        expect fetch-add ' native$'
        expect cmp-swap ' native$'
        expect masked-fetch-add 'emulated \(RDMA Read, then CmpSwap'
        expect swap 'emulated \(RDMA Read, then CmpSwap'
        if [[ $STAG_VM_KERNEL == 6.12 && $rdma_core == 55 ]]; then
            # 6.12's rxe advertises FLUSH and ATOMIC_WRITE
            # (device_cap_flags_ex bits 38-40), and rdma-core 55's librxe
            # takes IBV_QP_EX_WITH_FLUSH: Commit is a device FLUSH, except
            # into file-backed regions (the agent's msync).
            expect commit '^  commit +native \(ibv_wr_flush, IBV_FLUSH_GLOBAL: .*\); file-backed regions \(.*\): emulated \(a zero-length RDMA Read places earlier Writes, then the responder.s stag agent msyncs; ≥2 RTT\)$'
            expect atomic-write ' native$'
        elif [[ $STAG_VM_KERNEL == 6.12 ]]; then
            # rdma-core 44 has ibv_wr_atomic_write but no ibv_wr_flush.
            expect commit 'advertises FLUSH \(global\+persistent\), but stag was built against an rdma-core without ibv_wr_flush'
            expect atomic-write ' native$'
        else
            expect atomic-write 'emulated \(RDMA Read, then CmpSwap'
            expect commit 'emulated \(a zero-length RDMA Read places earlier Writes, then the responder.s stag agent msyncs; ≥2 RTT\)$'
        fi
    else
        local op
        for op in fetch-add cmp-swap masked-fetch-add masked-cmp-swap swap atomic-write; do
            expect "$op" "emulated \(the responder.s stag agent[^;]*; ≥1 RTT\)$"
        done
        expect commit 'emulated \(a zero-length RDMA Read places earlier Writes, then the responder.s stag agent msyncs; ≥2 RTT\)$'
        expect send-inv ' native$'
        expect '\(posts with\)' ' ibv_post_send$'
    fi
    expect imm 'emulated \(RDMA Write into the peer.s mailbox'
    expect write-imm 'emulated \(RDMA Write into the peer.s mailbox'
    return $ok
}

echo "== kernel $(uname -r), rdma-core $rdma_core"
# The library the binaries load is the release this run is about.
lib=$(ldd "$bin/stag" | sed -n 's/^[[:space:]]*libibverbs.so.1 => \([^ ]*\).*/\1/p')
lib=$(readlink -f "$lib")
echo "   libibverbs: $lib"
[[ $lib == *libibverbs.so.1.*.$rdma_core.0 ]]
one "libibverbs is rdma-core $rdma_core" $?
matrix=$(mktemp)
"$bin/stag" devices -v >"$matrix" 2>&1
cat "$matrix"
for kind in rxe siw; do
    # rxe's provider has the extended ibv_wr_* API; libsiw has none.
    if [[ $kind == rxe ]]; then
        dev=$STAG_RXE_DEV addr=$STAG_RXE_ADDR post=extended
    else
        dev=$STAG_SIW_DEV addr=$STAG_SIW_ADDR post=legacy
    fi
    export STAG_DEVICE=$dev STAG_ADDR=$addr STAG_IBV_DEVICE=$dev STAG_IBV_ADDR=$addr
    export STAG_EXPECT_POST_PATH=$post
    # What must run natively here (operations.rs checks the path it took).
    native=
    if [[ $kind == rxe && $STAG_VM_KERNEL == 6.12 ]]; then
        native=atomic-write
        [[ $rdma_core == 55 ]] && native=commit,atomic-write
    fi
    export STAG_EXPECT_NATIVE=$native
    echo "== $dev ($addr)"
    check_caps "$dev" "$kind" "$matrix"
    one "capability matrix" $?
    for t in "$@"; do
        name=${t%%=*} exe=${t#*=}
        if [[ $name == ibv_loopback ]]; then
            run_tests "$name" "$exe" --ignored
        elif [[ $name == cross_device ]]; then
            # stag0 and the kernel device on one iWARP fabric: siw only
            # (rxe speaks RoCE, which stag0 does not).
            [[ $kind == siw ]] && STAG_PEER_DEVICE=$dev run_tests "$name" "$exe" --ignored
        else
            run_tests "$name" "$exe"
        fi
    done
    # vm-suite.sh --ops-only leaves the examples out.
    ((${STAG_SUITE_EXAMPLES:-1})) || continue
    for e in quickstart counter lock durable_log stream async_quickstart async_stream_slots async_kv; do
        log=$(mktemp)
        t0=$(date +%s%N)
        timeout 300 "$bin/examples/$e" >"$log" 2>&1
        r=$?
        one "example $e" $r "$(tenths_since "$t0")"
        ((r == 0)) || tail -n 20 "$log" | sed 's/^/      /'
        rm -f "$log"
    done
done
echo "$passed $failed" >"$out/counts"
echo "== $(uname -r): $passed passed, $failed failed${failures[*]:+ (${failures[*]})}"
((failed == 0))
