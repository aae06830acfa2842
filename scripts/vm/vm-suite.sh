#!/usr/bin/env bash
# Builds on the host, then runs stag's verbs test-suite, the raw libibverbs
# loopback test and every example on kernel soft-RoCE (rxe0) and soft-iWARP
# (siw0), all inside one VM boot (scripts/vm/vm.sh), and checks the capability
# matrix each device shows. Prints one line per device and a summary:
#
#   vm-suite: N passed, M failed
#
# and exits non-zero on any failure, including a VM that cannot run (then the
# summary counts it as a failure: never a silent pass).
#
#   scripts/vm/vm-suite.sh [--kernel 6.12|6.1] [--rdma-core 44|55] [--timeout SECS] [--ops-only]
#
# --ops-only runs what depends on the kernel and rdma-core pair (the
# capability matrix and the binaries that run every operation on its native
# or emulated path: operations, emulation, api, srq, ibv_loopback,
# cross_device) and leaves out async_ops and the examples, which build on
# those operations and take three quarters of a full run under TCG. The gate
# runs the full suite on two pairs and --ops-only on the other two.
#
# --rdma-core 44 (the default) runs on Debian 12's rdma-core. 55 builds
# rdma-core v55 (scripts/vm/rdma-core.sh, cached), builds stag against its
# headers (ibv_wr_flush compiled in; in target/rdma-core-55) and runs
# everything in the guest with its libibverbs, librdmacm and providers.
set -euo pipefail
cd "$(dirname "$0")/../.."
KERNEL=${STAG_VM_KERNEL:-6.12}
RDMA_CORE=44
TIMEOUT=900
OPS_ONLY=0
while (($#)); do
    case $1 in
    --kernel) KERNEL=$2; shift 2 ;;
    --rdma-core) RDMA_CORE=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    --ops-only) OPS_ONLY=1; shift ;;
    -h | --help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "vm-suite: unknown argument $1" >&2; exit 2 ;;
    esac
done

# What the guest checks the loaded library against (suite.sh).
export STAG_RDMA_CORE=$RDMA_CORE
case $RDMA_CORE in
44)
    export STAG_SUITE_BIN=${CARGO_TARGET_DIR:-target}/debug
    unset STAG_RDMA_LIB
    ;;
55)
    prefix=$(bash scripts/vm/rdma-core.sh)
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target}/rdma-core-55
    export STAG_RDMA_INCLUDE_DIR=$prefix/include
    export STAG_SUITE_BIN=$CARGO_TARGET_DIR/debug STAG_RDMA_LIB=$prefix/lib
    ;;
*) echo "vm-suite: --rdma-core takes 44 or 55" >&2; exit 2 ;;
esac

echo "== vm-suite: building on the host (rdma-core $RDMA_CORE)"
cargo build --quiet --bins --examples
if [[ $RDMA_CORE == 55 ]]; then
    grep -qh 'rustc-cfg=has_ibv_wr_flush' "$CARGO_TARGET_DIR"/debug/build/rdma-sys-ext-*/output ||
        { echo "vm-suite: the build did not see ibv_wr_flush in $STAG_RDMA_INCLUDE_DIR" >&2; exit 1; }
fi
# The test executables, by target name (cargo prints each as JSON).
tests=()
while IFS= read -r line; do
    name=$(sed -n 's/.*"target":{[^}]*"name":"\([^"]*\)".*/\1/p' <<<"$line")
    exe=$(sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' <<<"$line")
    case $name in
    operations | emulation | srq | api | async_ops | ibv_loopback | cross_device) tests+=("$name=$exe") ;;
    esac
done < <(cargo test --quiet -p stag-verbs --features tokio --no-run --message-format=json 2>/dev/null |
    grep '"reason":"compiler-artifact"' | grep '"executable":"/')
((${#tests[@]} == 7)) || { echo "vm-suite: expected 7 test executables, found: ${tests[*]}" >&2; exit 1; }
export STAG_SUITE_EXAMPLES=1
if ((OPS_ONLY)); then
    kept=()
    for t in "${tests[@]}"; do
        [[ $t == async_ops=* ]] || kept+=("$t")
    done
    tests=("${kept[@]}")
    STAG_SUITE_EXAMPLES=0
fi

out=$(mktemp -d "${TMPDIR:-/tmp}/stag-vm-suite.XXXXXX")
trap 'rm -rf "$out"' EXIT
rc=0
scripts/vm/vm.sh --kernel "$KERNEL" --timeout "$TIMEOUT" --share "$out" -- \
    bash scripts/vm/suite.sh "$out" "${tests[@]}" || rc=$?
passed=0 failed=0
if [[ -f $out/counts ]]; then
    read -r passed failed <"$out/counts"
else
    echo "vm-suite: the VM run produced no results (vm.sh exit $rc)" >&2
fi
if ((rc != 0 && failed == 0)); then
    # The harness failed (exit 3), timed out (124) or the guest script died.
    echo "vm-suite: vm.sh exited $rc" >&2
    failed=$((failed + 1))
fi
echo "== vm-suite: kernel $KERNEL, rdma-core $RDMA_CORE$( ((OPS_ONLY)) && echo ', operations only')"
echo "vm-suite: $passed passed, $failed failed"
((failed == 0))
