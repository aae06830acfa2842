#!/usr/bin/env bash
# Builds rdma-core v55 (libibverbs, librdmacm, and the rxe and siw
# providers: nothing else) into a private directory next to the VM kernels,
# for the VM suite's "newer library" runs: Debian 12 ships rdma-core 44,
# which has no ibv_wr_flush, so the native Commit path never runs against
# it. Prints the directory; stag is built against its include/ (the
# STAG_RDMA_INCLUDE_DIR of rdma-sys-ext's build.rs) and run with its lib/
# first on LD_LIBRARY_PATH.
#
#   scripts/vm/rdma-core.sh            build if needed, print the directory
#
# The source is the rdma-core tree that the crates.io package
# ibverbs-sys 0.3.2+55.0 vendors (Debian's archive does not serve the
# rdma-core source, crates.io is reachable): taken from cargo's registry
# cache, downloaded there with `cargo fetch` of a throwaway manifest when
# it is missing. The build is IN_PLACE (rdma-core's own mode for running
# from the build tree): libibverbs looks for providers and their .driver
# files in the build tree, never in /usr, so the guest's Debian 12
# providers (built for 44's private ABI) are never mixed in. Built on the
# host, it runs on the host's glibc, which is the guest's (the guest runs
# the host's root read-only).
#
# Cache: $STAG_VM_CACHE, else $XDG_CACHE_HOME/stag-vm, else
# /var/cache/stag-vm; the subdirectory is named after the version and
# BUILD_KEY, and a .ready stamp marks a finished build. Needs cmake, ninja,
# libnl-3/libnl-route-3/libudev development packages (scripts/setup.sh).
set -euo pipefail

VERSION=55.0
CRATE=ibverbs-sys
CRATE_VERSION=0.3.2+$VERSION
BUILD_KEY=1 # bump when the configuration below changes

cache=${STAG_VM_CACHE:-${XDG_CACHE_HOME:+$XDG_CACHE_HOME/stag-vm}}
cache=${cache:-/var/cache/stag-vm}
dir=$cache/rdma-core-$VERSION-$BUILD_KEY
log() { printf 'rdma-core: %s\n' "$*" >&2; }
die() {
    printf 'rdma-core: error: %s\n' "$*" >&2
    exit 1
}

if [[ -e $dir/.ready ]]; then
    echo "$dir"
    exit 0
fi
mkdir -p "$cache"
# One builder at a time; a second caller waits, then finds it ready.
exec 9>"$cache/.rdma-core.lock"
flock 9
if [[ -e $dir/.ready ]]; then
    echo "$dir"
    exit 0
fi
for tool in cmake ninja cc pkg-config; do
    command -v "$tool" >/dev/null || die "$tool is missing (run scripts/setup.sh)"
done
t0=$(date +%s)

# The vendored source, from the registry's downloaded .crate (unpacked
# by us, so that cargo's registry/src, which cargo may clean, is not
# relied on).
cargo_home=${CARGO_HOME:-$HOME/.cargo}
find_crate() { compgen -G "$cargo_home/registry/cache/*/$CRATE-$CRATE_VERSION.crate" | head -n1; }
crate=$(find_crate || true)
if [[ -z $crate ]]; then
    log "fetching $CRATE $CRATE_VERSION from crates.io"
    tmp=$(mktemp -d)
    mkdir -p "$tmp/src"
    : >"$tmp/src/lib.rs"
    cat >"$tmp/Cargo.toml" <<EOF
[package]
name = "stag-rdma-core-fetch"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
$CRATE = "=$CRATE_VERSION"
EOF
    (cd "$tmp" && cargo fetch --quiet) || die "cargo fetch of $CRATE $CRATE_VERSION failed"
    rm -rf "$tmp"
    crate=$(find_crate || true)
    [[ -n $crate ]] || die "cargo fetched $CRATE but no $CRATE-$CRATE_VERSION.crate is in $cargo_home/registry/cache"
fi

rm -rf "$dir"
mkdir -p "$dir"
log "unpacking $(basename "$crate")"
tar -xzf "$crate" -C "$dir" "$CRATE-$CRATE_VERSION/vendor/rdma-core"
src=$dir/$CRATE-$CRATE_VERSION/vendor/rdma-core
grep -q 'ibv_wr_flush' "$src/libibverbs/verbs.h" || die "$src has no ibv_wr_flush"

# Only what stag loads: no man pages, no pyverbs, no static libraries, and
# only the ninja targets of the two libraries and two providers (the rest
# of rdma-core, ~30 tools and ~20 providers, is never compiled).
build=$dir/build
log "configuring"
cmake -S "$src" -B "$build" -G Ninja -DIN_PLACE=1 -DNO_MAN_PAGES=1 -DNO_PYVERBS=1 \
    -DENABLE_STATIC=0 -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$dir/cmake.log" 2>&1 ||
    { tail -n 30 "$dir/cmake.log" >&2; die "cmake failed (log: $dir/cmake.log)"; }
log "building libibverbs, librdmacm, librxe, libsiw"
# Providers are ninja targets named after the private ABI they link to.
pabi=$(sed -n 's/^set(IBVERBS_PABI_VERSION "\([0-9]*\)").*/\1/p' "$src/CMakeLists.txt")
[[ -n $pabi ]] || die "no IBVERBS_PABI_VERSION in $src/CMakeLists.txt"
ninja -C "$build" -j "$(nproc)" ibverbs rdmacm "rxe-rdmav$pabi" "siw-rdmav$pabi" \
    >"$dir/ninja.log" 2>&1 ||
    { tail -n 30 "$dir/ninja.log" >&2; die "ninja failed (log: $dir/ninja.log)"; }

# The .driver files of every provider exist after configure; keep rxe's
# and siw's, so that libibverbs does not try (and warn about) the others.
find "$build/etc/libibverbs.d" -name '*.driver' ! -name rxe.driver ! -name siw.driver -delete
[[ -f $build/etc/libibverbs.d/rxe.driver && -f $build/etc/libibverbs.d/siw.driver ]] ||
    die "no rxe.driver/siw.driver in $build/etc/libibverbs.d"
# build/include links into the source; a real copy is what stag builds
# against.
mkdir -p "$dir/include"
cp -rL "$build/include/." "$dir/include/"
ln -sfn build/lib "$dir/lib"
for f in lib/libibverbs.so.1 lib/librdmacm.so.1 include/infiniband/verbs.h include/rdma/rdma_cma.h; do
    [[ -e $dir/$f ]] || die "$dir/$f was not built"
done
echo "$VERSION" >"$dir/version"
touch "$dir/.ready"
log "built rdma-core $VERSION in $(($(date +%s) - t0)) s: $dir"
echo "$dir"
