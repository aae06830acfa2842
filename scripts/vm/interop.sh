#!/usr/bin/env bash
# Wire interop between stag's userspace iWARP provider and kernel soft-iWARP:
# runs every case of verbs/tests/siw_interop.rs (ignored tests, VM-only)
# inside the test VM.
#
#   scripts/vm/vm.sh -- scripts/vm/interop.sh [CASE...]
#
# Each case runs in its own process (both ends in one process: the
# provider over plain TCP, rdma_cm + libibverbs on siw0). Set
# STAG_INTEROP_PCAP=DIR (a --share directory) to capture every case with
# tcpdump into DIR/CASE.pcap (decode them with scripts/vm/fpdu-dump.py).
# Prints `interop: N passed, M failed`.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
[[ ${STAG_IN_VM:-0} == 1 ]] || { echo "interop.sh: run me inside scripts/vm/vm.sh" >&2; exit 2; }
# The test binary: $STAG_INTEROP_BIN, else the newest
# target/debug/deps/siw_interop-* that `cargo test -p stag-verbs --test
# siw_interop --no-run` (or the gate's `cargo test --workspace`) built.
bin=${STAG_INTEROP_BIN:-}
if [[ -z $bin ]]; then
    for f in $(ls -t "${CARGO_TARGET_DIR:-target}"/debug/deps/siw_interop-* 2>/dev/null); do
        [[ -x $f && $f != *.d ]] && { bin=$f; break; }
    done
fi
[[ -n $bin && -x $bin ]] || { echo "interop.sh: the siw_interop test is not built (cargo test -p stag-verbs --test siw_interop --no-run)" >&2; exit 2; }

echo "siw module parameters:"
if [[ -d /sys/module/siw/parameters ]]; then
    grep -H . /sys/module/siw/parameters/* 2>/dev/null | sed 's/^/  /'
else
    echo "  none (/sys/module/siw/parameters does not exist: mpa_crc_required, mpa_crc_strict and peer_to_peer are compile-time constants in siw)"
fi

# (no process substitution: the guest has no /dev/fd)
# Case names are the test names (`stag_client_crc: test` in the list).
if (($#)); then cases=("$@"); else read -r -d '' -a cases <<<"$("$bin" --list --ignored | sed -n 's/: test$//p')"; fi
((${#cases[@]})) || { echo "interop.sh: no cases" >&2; exit 1; }
passed=0 failed=0
for c in "${cases[@]}"; do
    dump=
    if [[ -n ${STAG_INTEROP_PCAP:-} ]] && command -v tcpdump >/dev/null; then
        tcpdump -i lo -B 65536 -s 0 -U -w "$STAG_INTEROP_PCAP/$c.pcap" 'tcp and net 10.12.0.0/24' 2>/dev/null &
        dump=$!
        sleep 0.5
    fi
    out=$(timeout 120 "$bin" --ignored --exact --nocapture --test-threads=1 "$c" 2>&1)
    rc=$?
    [[ -n $dump ]] && { sleep 1; kill -INT "$dump"; wait "$dump" 2>/dev/null; }
    printf '%s\n' "$out" | grep -v '^interop:'
    line=$(printf '%s\n' "$out" | sed -n 's/^interop: \([0-9]*\) passed, \([0-9]*\) failed$/\1 \2/p')
    if [[ -n $line ]]; then
        read -r p f <<<"$line"
        passed=$((passed + p)) failed=$((failed + f))
        ((rc == 0 || f > 0)) || failed=$((failed + 1))
    else
        echo "FAIL $c: exited $rc without a summary"
        failed=$((failed + 1))
    fi
    # siw's own view (it logs each Terminate it receives).
    dmesg 2>/dev/null | grep -i 'siw' | grep -iv 'taint' | sed 's/^/  dmesg: /'
    dmesg -C 2>/dev/null
done
echo "interop: $passed passed, $failed failed"
((failed == 0 && passed > 0))
