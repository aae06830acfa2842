#!/usr/bin/env bash
# Builds on the host, then runs stag's verbs test-suite, the raw libibverbs
# loopback test and every example on kernel soft-RoCE (rxe0) and soft-iWARP
# (siw0), all inside one VM boot (scripts/vm.sh), and checks the capability
# matrix each device shows. Prints one line per device and a summary:
#
#   vm-suite: N passed, M failed
#
# and exits non-zero on any failure, including a VM that cannot run (then the
# summary counts it as a failure: never a silent pass).
#
#   scripts/vm-suite.sh [--kernel 6.12|6.1] [--timeout SECS]
set -euo pipefail
cd "$(dirname "$0")/.."
KERNEL=${STAG_VM_KERNEL:-6.12}
TIMEOUT=900
while (($#)); do
    case $1 in
    --kernel) KERNEL=$2; shift 2 ;;
    --timeout) TIMEOUT=$2; shift 2 ;;
    -h | --help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "vm-suite: unknown argument $1" >&2; exit 2 ;;
    esac
done

echo "== vm-suite: building on the host"
cargo build --quiet --bins --examples
# The test executables, by target name (cargo prints each as JSON).
tests=()
while IFS= read -r line; do
    name=$(sed -n 's/.*"target":{[^}]*"name":"\([^"]*\)".*/\1/p' <<<"$line")
    exe=$(sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' <<<"$line")
    case $name in
    operations | emulation | srq | ibv_loopback | cross_device) tests+=("$name=$exe") ;;
    esac
done < <(cargo test --quiet -p stag-verbs --no-run --message-format=json 2>/dev/null |
    grep '"reason":"compiler-artifact"' | grep '"executable":"/')
((${#tests[@]} == 5)) || { echo "vm-suite: expected 5 test executables, found: ${tests[*]}" >&2; exit 1; }

out=$(mktemp -d "${TMPDIR:-/tmp}/stag-vm-suite.XXXXXX")
trap 'rm -rf "$out"' EXIT
for attempt in 1 2; do
    rc=0
    scripts/vm.sh --kernel "$KERNEL" --timeout "$TIMEOUT" --share "$out" -- \
        bash scripts/vm/suite.sh "$out" "${tests[@]}" || rc=$?
    # A TCG guest that dies before running anything (exit 3, no results:
    # seen once in a few dozen 6.12 boots) gets one more boot; a test
    # failure or a timeout never does.
    if ((rc == 3)) && [[ ! -f $out/counts ]] && ((attempt == 1)); then
        echo "vm-suite: the VM ran nothing (vm.sh exit 3); booting once more" >&2
        continue
    fi
    break
done
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
echo "vm-suite: $passed passed, $failed failed"
((failed == 0))
