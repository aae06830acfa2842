#!/bin/sh
# Inside the VM (scripts/vm/vm.sh -- sh scripts/vm/postpath-compare.sh, after
# cargo build --release --bin stag): `stag lat` on rxe0 through the
# extended ibv_wr_* post path and through ibv_post_send (--legacy-post),
# alternated over three rounds so both see the same machine. Prints the
# perftest-style row (bytes iters t_min t_max t_typical t_avg ...) of each.
set -u
for r in 1 2 3; do
  for op in write send fetch-add; do
    for p in "" "--legacy-post"; do
      printf "%s %s %s: " "$r" "$op" "${p:-extended}"
      STAG_DEVICE=$STAG_RXE_DEV timeout 120 target/release/stag lat "$op" --loopback \
        --bind "$STAG_RXE_ADDR" -n 1000 $p 2>&1 | grep -E "^ *[0-9]" | tail -1
    done
  done
done
