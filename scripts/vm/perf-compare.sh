#!/bin/sh
# Inside the VM (scripts/vm/vm.sh -- sh scripts/vm/perf-compare.sh, after
# cargo build --release --bin stag): perftest and `stag lat` on the same
# device in the same run, so the wrapper's overhead shows as a ratio. Prints
# the perftest-style result row of each.
set -u
run_pair() { # dev addr perftest-binary extra
  dev=$1; addr=$2; tool=$3; shift 3
  $tool -d $dev -R -n 500 -F "$@" >/tmp/srv.$tool.$dev 2>&1 &
  sleep 2
  $tool -d $dev -R -n 500 -F "$@" $addr 2>&1 | grep -E "^ *[0-9]" | tail -1
  wait
}
for d in rxe siw; do
  if [ $d = rxe ]; then dev=$STAG_RXE_DEV; addr=$STAG_RXE_ADDR; else dev=$STAG_SIW_DEV; addr=$STAG_SIW_ADDR; fi
  echo "== $dev ib_write_lat (bytes iters t_min t_max t_typical t_avg ...)"
  run_pair $dev $addr ib_write_lat
  echo "== $dev stag lat write"
  STAG_DEVICE=$dev timeout 120 target/release/stag lat write --loopback --bind $addr -n 500 2>&1 | grep -E "^ *[0-9]" | tail -1
  echo "== $dev ib_read_lat"
  run_pair $dev $addr ib_read_lat
  echo "== $dev stag lat read"
  STAG_DEVICE=$dev timeout 120 target/release/stag lat read --loopback --bind $addr -n 500 2>&1 | grep -E "^ *[0-9]" | tail -1
  echo "== $dev ib_send_lat"
  run_pair $dev $addr ib_send_lat
  echo "== $dev stag lat send"
  STAG_DEVICE=$dev timeout 120 target/release/stag lat send --loopback --bind $addr -n 500 2>&1 | grep -E "^ *[0-9]" | tail -1
done
echo "== rxe0 ib_atomic_lat"
run_pair $STAG_RXE_DEV $STAG_RXE_ADDR ib_atomic_lat
echo "== rxe0 stag lat fetch-add"
STAG_DEVICE=$STAG_RXE_DEV timeout 120 target/release/stag lat fetch-add --loopback --bind $STAG_RXE_ADDR -n 500 2>&1 | grep -E "^ *[0-9]" | tail -1
