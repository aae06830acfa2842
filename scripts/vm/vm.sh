#!/usr/bin/env bash
# Runs a command inside a throw-away QEMU VM that boots one of Debian's own
# kernels with kernel soft-RoCE (rdma_rxe -> rxe0) and soft-iWARP (siw -> siw0)
# devices ready, because the host kernel has no RDMA at all.
#
#   scripts/vm/vm.sh [options] [--] CMD [ARGS...]   run CMD in the VM
#   scripts/vm/vm.sh [options] --check              smoke test (scripts/vm/check.sh)
#   scripts/vm/vm.sh [options] --prepare            only install + fill the cache
#
# Options:
#   --kernel 6.12|6.1   kernel series to boot (default 6.12, or $STAG_VM_KERNEL)
#   --timeout SECS      whole-run limit incl. boot (default 600; 0 = none)
#   --share DIR         mount host DIR read-write at the same path (repeatable)
#   --mem MB            guest RAM (default 1024)   --cpus N  guest CPUs (default 2)
#   -v, --verbose       stream the guest console (kernel log) to stderr
#
# Inside the VM the command runs as root with cwd = the directory vm.sh was
# started from. The host's / is visible read-only at the same paths under a
# tmpfs overlay: the project tree, target/, ~/.cargo and rdma-core all work,
# but writes vanish when the VM stops unless they go to a --share directory.
# Environment: PATH HOME USER LANG TERM, RUST_*/CARGO_*/STAG_* from the host,
# plus STAG_IN_VM=1, STAG_VM_KERNEL, STAG_RXE_DEV=rxe0 STAG_RXE_ADDR=10.11.0.1
# STAG_RXE_NETDEV=dummy0, STAG_SIW_DEV=siw0 STAG_SIW_ADDR=10.12.0.1
# STAG_SIW_NETDEV=dummy1. Those addresses live only on dummy netdevs inside the
# VM, which has no network card: nothing leaves it.
# CMD is exec'd as is (use `bash -c '...'` for shell syntax). Its stdout and
# stderr stream to vm.sh's own (they are terminals in the VM only where vm.sh's
# are); stdin is empty.
#
# Exit status: the command's own, or
#   124  the --timeout expired (the VM was killed)
#     3  the harness could not run (missing tools, download or build failure,
#        guest setup failure, VM crash): always with a "vm.sh: error:" line
#     2  usage error
#
# Cache (kernels, siw.ko, initramfs): $STAG_VM_CACHE, else
# $XDG_CACHE_HOME/stag-vm, else /var/cache/stag-vm: ~250 MB for 6.12, ~520 MB
# for 6.1 (uncompressed modules). A cold run downloads ~280 MB (6.12) or
# ~225 MB (6.1) and takes ~45 s; a warm run needs no network at all.
# Needs root for apt-get; everything else it needs it installs itself.
# Other knobs: STAG_VM_STRICT=1 (no fallback from a pinned kernel),
# STAG_VM_KEEP=1 (keep the run's temp dir with console.log), STAG_VM_ACCEL.
set -Eeuo pipefail
# Any unexpected failure is a harness error (exit 3), never a silent exit 1
# that could pass for the command's own status.
trap 'die "unexpected failure at line $LINENO: $BASH_COMMAND"' ERR

# This directory: init.sh and check.sh live next to vm.sh.
VM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# ---------------------------------------------------------------------------
# Pinned kernels (Debian bookworm / bookworm-security), so that runs are
# reproducible. Security updates drop old ABIs from the archive after a while:
# if the pinned one cannot be had, vm.sh says so loudly and falls back to the
# newest ABI that the series' meta package points at (STAG_VM_STRICT=1 makes
# that an error instead). A kernel already in the cache never needs apt.
#   series  ABI              package version      kbuild package           meta package
PINS=(
    "6.12   6.12.117+deb12   6.12.117-1~deb12u1   linux-kbuild-6.12.117+deb12  linux-image-6.12-amd64"
    "6.1    6.1.0-56         6.1.192-2            linux-kbuild-6.1             linux-image-amd64"
)
# Host packages: QEMU, the initramfs' busybox, the siw.ko toolchain, and the
# userspace RDMA stack that the guest runs from the host's root.
HOST_PKGS=(qemu-system-x86 busybox-static gcc-12 make kmod xz-utils zstd iproute2
    rdma-core ibverbs-providers libibverbs1 librdmacm1 ibverbs-utils
    rdmacm-utils perftest)
# Modules for the initramfs; their dependencies are resolved with the unpacked
# kernel's modules.dep. Crypto first: libcrc32c and rxe look their algorithm up
# through the crypto API when they load and there is no modprobe to fetch it.
# "?" marks modules that may fail to load (crc32c-intel needs SSE4.2).
MODULES=(crc32c_generic crc32c-intel? crc32_generic? crc32-pclmul?
    virtio_pci 9pnet_virtio 9p overlay dummy veth
    ib_uverbs rdma_ucm rdma_rxe siw)
INITRAMFS_FORMAT=1 # bump to force every cached initramfs to be rebuilt

RXE_ADDR=10.11.0.1
SIW_ADDR=10.12.0.1

# ---------------------------------------------------------------------------
log() { printf 'vm.sh: %s\n' "$*" >&2; }
die() {
    printf 'vm.sh: error: %s\n' "$*" >&2
    exit 3
}
usage() {
    sed -n '2,/^set -Eeuo/{/^set -Eeuo/d;s/^# \{0,1\}//;p}' "$0"
    exit "${1:-0}"
}
now_us() { echo "${EPOCHREALTIME/./}"; }
secs() { printf '%d.%01d' "$(($1 / 1000000))" "$(($1 % 1000000 / 100000))"; }

# ---------------------------------------------------------------------------
# Host packages. Install only what is missing, and update apt's lists at most
# once (and only when they are needed: a warm run touches no network at all).
APT_UPDATED=0
apt_update_once() {
    ((APT_UPDATED)) && return 0
    log "apt-get update"
    apt-get update -qq >&2 || die "apt-get update failed"
    APT_UPDATED=1
}

ensure_host_packages() {
    local missing=() p
    for p in "${HOST_PKGS[@]}"; do
        dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii' ||
            missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    ((EUID == 0)) || die "missing host packages (run as root to install): ${missing[*]}"
    apt_update_once
    log "installing: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${missing[@]}" >&2 || die "apt-get install ${missing[*]} failed"
}

# ---------------------------------------------------------------------------
# Kernel selection: sets K_SERIES K_ABI K_VERSION K_KBUILD K_DIR K_REL.
select_kernel() {
    local series=$1 row s abi ver kbuild meta
    for row in "${PINS[@]}"; do
        read -r s abi ver kbuild meta <<<"$row"
        [[ $s == "$series" ]] && break
        s=
    done
    [[ -n $s ]] || { log "unknown kernel series '$series' (have: 6.12, 6.1)"; exit 2; }
    K_SERIES=$s K_META=$meta
    set_kernel "$abi" "$ver" "$kbuild"
    [[ -e $K_DIR/.ready ]] && return 0 # cached: no apt needed

    apt_lists_present || apt_update_once
    pinned_available && return 0
    cached_fallback && return 0 # an earlier fallback; no apt-get update each run
    apt_update_once
    pinned_available || fall_back_to_newest
}

# A kernel of the same series that an earlier run fell back to, if cached.
cached_fallback() {
    local d s abi ver kbuild
    for d in "$CACHE"/linux-*/; do
        [[ -e $d/.ready && -f $d/pin ]] || continue
        read -r s abi ver kbuild <"$d/pin"
        [[ $s == "$K_SERIES" ]] || continue
        log "WARNING: pinned kernel $K_ABI ($K_VERSION) is not in the archive; using the cached $abi ($ver)"
        [[ ${STAG_VM_STRICT:-0} == 1 ]] && die "STAG_VM_STRICT=1: not falling back"
        set_kernel "$abi" "$ver" "$kbuild"
        return 0
    done
    return 1
}

set_kernel() {
    K_ABI=$1 K_VERSION=$2 K_KBUILD=$3
    K_REL=$K_ABI-amd64 # uname -r
    K_DIR=$CACHE/linux-${K_ABI}_$K_VERSION
}

apt_lists_present() {
    compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null
}

# Is every package of the pinned kernel still in the archive at its version?
# (The kbuild package at its own version: see kbuild_version.)
pinned_available() {
    local p
    for p in "linux-image-$K_REL" "linux-headers-$K_REL" "linux-headers-$K_ABI-common" \
        "linux-source-$K_SERIES"; do
        apt-cache madison "$p" 2>/dev/null |
            awk -F'|' -v v="$K_VERSION" '{ gsub(/ /, "", $2) } $2 == v { f = 1 } END { exit !f }' ||
            return 1
    done
    [[ -n $(kbuild_version) ]]
}

# The version of the kbuild package to unpack beside the kernel's headers:
# the newest in the archive that is not older than the kernel. The headers
# ask for no more (linux-kbuild-6.1 (>= 6.1.192-2)), and Debian rebuilds
# the series' kbuild package on its own (6.1.192-3 beside a 6.1.192-2
# kernel), dropping the older one from the security archive.
kbuild_version() {
    local v best=
    while read -r v; do
        dpkg --compare-versions "$v" ge "$K_VERSION" || continue
        if [[ -z $best ]] || dpkg --compare-versions "$v" gt "$best"; then
            best=$v
        fi
    done < <(apt-cache madison "$K_KBUILD" 2>/dev/null | awk -F'|' '{ gsub(/ /, "", $2); print $2 }')
    echo "$best"
}

fall_back_to_newest() {
    local image ver kbuild
    log "WARNING: pinned kernel $K_ABI ($K_VERSION) is no longer in the archive"
    [[ ${STAG_VM_STRICT:-0} == 1 ]] && die "STAG_VM_STRICT=1: not falling back"
    image=$(apt-cache show --no-all-versions "$K_META" 2>/dev/null |
        sed -n 's/^Depends:.*\(linux-image-[^ ,]*-amd64\).*/\1/p' | head -n1)
    [[ -n $image ]] || die "cannot resolve $K_META to a kernel package"
    ver=$(apt-cache policy "$image" | sed -n 's/^ *Candidate: //p')
    [[ -n $ver && $ver != "(none)" ]] || die "no installable version of $image"
    # 6.1's kbuild package is per series, 6.12's per ABI: ask the headers.
    kbuild=$(apt-cache show "linux-headers-${image#linux-image-}=$ver" 2>/dev/null |
        sed -n 's/^Depends:.*\(linux-kbuild-[^ ,]*\).*/\1/p' | head -n1)
    [[ -n $kbuild ]] || die "cannot find the kbuild package for $image"
    set_kernel "$(sed 's/^linux-image-//;s/-amd64$//' <<<"$image")" "$ver" "$kbuild"
    log "WARNING: falling back to $image $ver (update PINS in $0 to make this reproducible)"
}

# ---------------------------------------------------------------------------
# Cache filling: download + unpack the kernel, build siw.ko, build the
# initramfs' static part. Each step leaves a stamp, so a warm run is a no-op.
prepare_kernel() {
    [[ -e $K_DIR/.ready ]] && return 0
    local t0 debs root
    t0=$(now_us)
    log "preparing kernel $K_REL ($K_VERSION) in $K_DIR"
    rm -rf "$K_DIR"
    mkdir -p "$K_DIR/debs"
    debs=$K_DIR/debs root=$K_DIR/root
    # apt-get download writes to the cwd; _apt cannot write to a root-owned
    # cache, so it downloads unsandboxed (harmless warning, filtered).
    local kbuild_ver
    kbuild_ver=$(kbuild_version)
    [[ -n $kbuild_ver ]] || die "no $K_KBUILD of version $K_VERSION or later in the archive"
    (cd "$debs" && apt-get download -q \
        "linux-image-$K_REL=$K_VERSION" "linux-headers-$K_REL=$K_VERSION" \
        "linux-headers-$K_ABI-common=$K_VERSION" "$K_KBUILD=$kbuild_ver" \
        "linux-source-$K_SERIES=$K_VERSION" 2>&1 | { grep -v 'unsandboxed' >&2 || true; }) ||
        die "downloading the $K_REL kernel packages failed"
    local deb
    for deb in "$debs"/linux-{image,headers,kbuild}-*.deb; do
        dpkg-deb -x "$deb" "$root" || die "unpacking $deb failed"
    done
    [[ -f $root/boot/vmlinuz-$K_REL ]] || die "no vmlinuz-$K_REL in the image package"
    build_siw
    depmod -b "$root" "$K_REL" || die "depmod failed"
    rm -rf "$debs" # ~270 MB; the unpacked tree is all later runs need
    echo "$K_SERIES $K_ABI $K_VERSION $K_KBUILD" >"$K_DIR/pin"
    touch "$K_DIR/.ready"
    log "kernel $K_REL prepared in $(secs $(($(now_us) - t0)))s"
}

# Debian builds without CONFIG_RDMA_SIW, so build siw.ko out of tree from the
# matching linux-source against the matching headers.
build_siw() {
    local root=$K_DIR/root src=$K_DIR/siw hdr
    hdr=$root/usr/src/linux-headers-$K_REL
    # The headers' Makefile includes the -common one by absolute /usr/src path.
    sed -i "s|^include /usr/src/|include $root/usr/src/|" "$hdr/Makefile"
    mkdir -p "$src"
    dpkg-deb --fsys-tarfile "$K_DIR"/debs/linux-source-*.deb |
        tar -xO "./usr/src/linux-source-$K_SERIES.tar.xz" | xz -dc |
        tar -x -C "$src" --strip-components=5 --wildcards \
            "linux-source-$K_SERIES/drivers/infiniband/sw/siw/*" ||
        die "extracting the siw sources failed"
    [[ -f $src/siw_main.c ]] || die "no siw sources in linux-source-$K_SERIES"
    # CONFIG_DEBUG_INFO_BTF_MODULES= : no pahole needed, no BTF wanted.
    make -s -C "$hdr" M="$src" CONFIG_RDMA_SIW=m CONFIG_DEBUG_INFO_BTF_MODULES= \
        modules >"$K_DIR/siw-build.log" 2>&1 ||
        { tail -n 30 "$K_DIR/siw-build.log" >&2; die "building siw.ko failed (log: $K_DIR/siw-build.log)"; }
    mkdir -p "$root/lib/modules/$K_REL/updates"
    cp "$src/siw.ko" "$root/lib/modules/$K_REL/updates/siw.ko"
}

# The bzImage decompresses itself, which costs seconds under TCG (6.1's is xz:
# ~5 s). So unpack the ELF vmlinux inside it once; QEMU boots that directly
# through its PVH entry point. Any doubt: no vmlinux, and the bzImage is used.
prepare_vmlinux() {
    local img=$K_DIR/root/boot/vmlinuz-$K_REL out=$K_DIR/vmlinux off dec
    [[ -e $out || -e $out.none ]] && return 0
    for dec in xz zstd; do
        case $dec in
        xz) off=$(LC_ALL=C grep -obUaP -m1 '\xfd7zXZ\x00' "$img" | head -n1 | cut -d: -f1) || off= ;;
        zstd) off=$(LC_ALL=C grep -obUaP -m1 '\x28\xb5\x2f\xfd' "$img" | head -n1 | cut -d: -f1) || off= ;;
        esac
        [[ -n $off ]] || continue
        # The payload is followed by other data, hence "|| true" and the
        # checks below instead of the decompressor's exit status.
        case $dec in
        xz) tail -c +$((off + 1)) "$img" | xz -dc --single-stream >"$out.tmp" 2>/dev/null || true ;;
        zstd) tail -c +$((off + 1)) "$img" | zstd -dcq >"$out.tmp" 2>/dev/null || true ;;
        esac
        # An ELF with a XEN_ELFNOTE_PHYS32_ENTRY (0x12) note is PVH-bootable.
        if [[ $(head -c 4 "$out.tmp" | od -An -c | tr -d ' ') == 177ELF ]] &&
            readelf -n "$out.tmp" 2>/dev/null | grep -q 'type: (0x00000012)'; then
            mv "$out.tmp" "$out"
            return 0
        fi
    done
    rm -f "$out.tmp"
    log "note: no PVH-bootable vmlinux in $img; booting the bzImage (slower)"
    touch "$out.none"
}

# The static part of the initramfs: busybox + the modules (decompressed, since
# busybox insmod cannot read .ko.xz) + their load order. /init itself is
# appended per run (see make_initrd), so editing init.sh needs no rebuild.
prepare_initramfs() {
    local out=$K_DIR/initramfs-base.cpio key
    key="$INITRAMFS_FORMAT ${MODULES[*]} $(dpkg-query -W -f='${Version}' busybox-static)"
    [[ -f $out && $(cat "$out.key" 2>/dev/null) == "$key" ]] && return 0
    local root=$K_DIR/root stage=$K_DIR/initramfs.tmp m name opt seen=" " line path f
    rm -rf "$stage"
    mkdir -p "$stage"/{bin,dev,proc,sys,tmp,lib/modules}
    cp /bin/busybox "$stage/bin/busybox"
    : >"$stage/lib/modules/order"
    for m in "${MODULES[@]}"; do
        name=${m%\?} opt=req
        [[ $m == *\? ]] && opt=opt
        if ! line=$(modprobe -C /dev/null -d "$root" -S "$K_REL" --show-depends "$name" 2>&1); then
            [[ $opt == opt ]] && continue
            die "module $name: $line"
        fi
        while read -r f path _; do
            [[ $f == insmod ]] || continue # "builtin x" needs nothing
            f=$(basename "$path")
            f=${f%.xz}
            [[ $seen == *" $f "* ]] && continue
            seen+="$f "
            case $path in
            *.xz) xz -dc "$path" >"$stage/lib/modules/$f" ;;
            *) cp "$path" "$stage/lib/modules/$f" ;;
            esac
            # Only the module asked for may fail; its dependencies are needed.
            local need=req params=
            [[ $f == "$name.ko" || $f == "${name//-/_}.ko" ]] && need=$opt
            [[ $f == dummy.ko ]] && params=numdummies=0
            echo "$f $need $params" >>"$stage/lib/modules/order"
        done <<<"$line"
    done
    (cd "$stage" && find . | busybox cpio -o -H newc --quiet) >"$out.tmp" ||
        die "writing the initramfs failed"
    mv "$out.tmp" "$out"
    echo "$key" >"$out.key"
    rm -rf "$stage"
}

# Per run: the cached static part + a tiny archive with the current /init (the
# kernel unpacks concatenated cpio archives in order).
make_initrd() {
    local stage=$CTL/initcpio
    mkdir -p "$stage"
    install -m 0755 "$VM_DIR/init.sh" "$stage/init"
    (cd "$stage" && echo init | busybox cpio -o -H newc --quiet) >"$CTL/init.cpio"
    cat "$K_DIR/initramfs-base.cpio" "$CTL/init.cpio" >"$CTL/initrd"
    rm -rf "$stage" "$CTL/init.cpio"
}

# ---------------------------------------------------------------------------
# The command and its environment, as a bash script the guest's init runs in
# the chroot under env -i.
write_command() {
    local cwd=$PWD v
    {
        echo "# generated by vm.sh"
        for v in $(compgen -e); do
            [[ $v =~ ^(PATH|HOME|USER|LOGNAME|LANG|LC_[A-Z]+|TERM|TZ|RUST[A-Z_]*|CARGO[A-Z_]*|STAG_[A-Z_]+)$ ]] ||
                continue
            printf 'export %s=%q\n' "$v" "${!v}"
        done
        printf 'export %s=%q\n' STAG_IN_VM 1 STAG_VM_KERNEL "$K_SERIES" \
            STAG_RXE_DEV rxe0 STAG_RXE_ADDR "$RXE_ADDR" STAG_RXE_NETDEV dummy0 \
            STAG_SIW_DEV siw0 STAG_SIW_ADDR "$SIW_ADDR" STAG_SIW_NETDEV dummy1 \
            STAG_VM_SHARES "${SHARES[*]}"
        printf 'cd %q || { echo "vm.sh (guest): cannot cd to %q" >&2; exit 3; }\n' "$cwd" "$cwd"
        printf 'exec'
        printf ' %q' "${CMD[@]}"
        echo
    } >"$CTL/cmd.sh"
    # Whether the command's stdout/stderr should be a terminal in the VM.
    local tty_out=0 tty_err=0
    [[ -t 1 ]] && tty_out=1
    [[ -t 2 ]] && tty_err=1
    {
        printf 'STAG_RXE_ADDR=%q\nSTAG_SIW_ADDR=%q\nSTAG_VM_SHARES=%q\n' \
            "$RXE_ADDR" "$SIW_ADDR" "${SHARES[*]}"
        printf 'STAG_VM_TTY_OUT=%d\nSTAG_VM_TTY_ERR=%d\n' "$tty_out" "$tty_err"
    } >"$CTL/env.sh"
}

# The kernel to hand QEMU: the decompressed ELF vmlinux (booted through its
# PVH entry point) when there is one, else the bzImage.
kernel_image() {
    if [[ -s $K_DIR/vmlinux && ${STAG_VM_BZIMAGE:-0} != 1 ]]; then
        echo "$K_DIR/vmlinux"
    else
        echo "$K_DIR/root/boot/vmlinuz-$K_REL"
    fi
}

# Only real hardware virtualisation: this host's kvm_pvm accepts guests that
# then die, so KVM is used only where kvm_intel/kvm_amd is loaded.
pick_accel() {
    if [[ -n ${STAG_VM_ACCEL:-} ]]; then
        echo "$STAG_VM_ACCEL"
    elif [[ -w /dev/kvm ]] && [[ -d /sys/module/kvm_intel || -d /sys/module/kvm_amd ]]; then
        echo kvm
    else
        echo tcg
    fi
}

# ---------------------------------------------------------------------------
QPID=
# shellcheck disable=SC2317 # invoked by the EXIT trap
cleanup() {
    [[ -n $QPID ]] && kill -9 "$QPID" 2>/dev/null
    [[ -n ${TAILPID:-} ]] && kill "$TAILPID" 2>/dev/null
    [[ -n ${CTL:-} && -d $CTL && ${STAG_VM_KEEP:-0} != 1 ]] && rm -rf "$CTL"
    return 0
}

run_vm() {
    local accel cpu append i
    accel=$(pick_accel)
    cpu=max
    [[ $accel == kvm ]] && cpu=host
    # quiet: only warnings and our own lines on the console. tsc=reliable: a
    # 6.12 boot under TCG panicked without it (clocksource watchdog).
    append="console=ttyS0 panic=-1 tsc=reliable mitigations=off"
    # maxcpus=1: the kernel boots, loads the modules and sets up the devices
    # on one CPU, and init.sh brings the others up just before the command.
    # Under TCG, a boot on two vCPUs oopsed about once in a hundred (int3
    # in sched_clock_cpu, on the vCPU that took an IPI while the other
    # patched that static branch at late init: QEMU's multi-threaded TCG
    # can run a stale translation of text the kernel is patching). On one
    # CPU nothing runs beside the patching.
    ((CPUS > 1)) && [[ $accel == tcg ]] && append+=" maxcpus=1"
    ((VERBOSE)) || append+=" quiet loglevel=4"
    append+=" rdinit=/init 8250.nr_uarts=4"
    # shellcheck disable=SC2054 # the commas are QEMU's, not array separators
    local args=(
        -accel "$accel" -M pc -cpu "$cpu" -smp "$CPUS" -m "$MEM"
        -nodefaults -no-user-config -display none -monitor none -no-reboot
        -bios /usr/share/qemu/qboot.rom
        -kernel "$(kernel_image)" -initrd "$CTL/initrd" -append "$append"
        -nic none
        # ttyS0: kernel console + init's markers, ttyS1: stdout, ttyS2: stderr.
        # stdout/stderr reach QEMU as pipes (fds 5 and 6, see below) to cat
        # processes that hold our own stdout/stderr, so QEMU never reopens or
        # changes the caller's files or terminal.
        -serial "file:$CTL/console.log"
        -add-fd fd=5,set=5 -chardev file,id=out,path=/dev/fdset/5,append=on -serial chardev:out
        # ttyS2 would share IRQ 4 with ttyS0 and then never transmits: give it
        # IRQ 5 (QEMU's ACPI tables tell the guest).
        -add-fd fd=6,set=6 -chardev file,id=err,path=/dev/fdset/6,append=on
        -device isa-serial,chardev=err,index=2,irq=5
        -fsdev local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap
        -device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot
        -fsdev local,id=stagctl,path="$CTL",security_model=none
        -device virtio-9p-pci,fsdev=stagctl,mount_tag=stagctl
    )
    for i in "${!SHARES[@]}"; do
        args+=(-fsdev "local,id=share$i,path=${SHARES[$i]},security_model=none"
            -device "virtio-9p-pci,fsdev=share$i,mount_tag=share$i")
    done

    local t0 t_ready='' deadline=0 timed_out=0 qrc=0 rc
    t0=$(now_us)
    ((TIMEOUT > 0)) && deadline=$((t0 + TIMEOUT * 1000000))
    local outpid errpid
    exec 5> >(exec cat)
    outpid=$!
    exec 6> >(exec cat >&2)
    errpid=$!
    "$QEMU" "${args[@]}" </dev/null &
    QPID=$!
    exec 5>&- 6>&- # QEMU holds them now: the cats end when QEMU does
    if ((VERBOSE)); then
        # Ends by itself once QEMU has gone (--pid), after the last lines.
        tail -n +1 -F --pid="$QPID" "$CTL/console.log" 2>/dev/null | tr -d '\r' >&2 &
        TAILPID=$!
    fi
    while kill -0 "$QPID" 2>/dev/null; do
        [[ -z $t_ready && -e $CTL/ready ]] && t_ready=$(now_us)
        if ((deadline && $(now_us) > deadline)); then
            timed_out=1
            kill "$QPID" 2>/dev/null || true
            sleep 1
            kill -9 "$QPID" 2>/dev/null || true
            break
        fi
        sleep 0.1
    done
    wait "$QPID" || qrc=$?
    QPID=
    wait "$outpid" "$errpid" 2>/dev/null || true # all output written out
    if [[ -n ${TAILPID:-} ]]; then
        wait "$TAILPID" 2>/dev/null || true
        TAILPID=
    fi
    local t_end timing
    t_end=$(now_us)
    timing="total $(secs $((t_end - t0)))s"
    if [[ -n $t_ready ]]; then
        # The guest's own uptime at "ready" excludes QEMU start and firmware.
        timing="boot+setup $(secs $((t_ready - t0)))s (guest uptime $(<"$CTL/ready")s), $timing"
    fi

    if ((timed_out)); then
        log "TIMEOUT: killed the VM after ${TIMEOUT}s ($timing)"
        console_tail
        exit 124
    fi
    if [[ -f $CTL/rc ]]; then
        rc=$(<"$CTL/rc")
    else
        rc=$(sed -n 's/^STAG_VM_EXIT=\([0-9]*\).*/\1/p' "$CTL/console.log" 2>/dev/null | tail -n1) || rc=
    fi
    if [[ ! $rc =~ ^[0-9]+$ ]]; then
        local why
        why=$(tr -d '\r' <"$CTL/console.log" 2>/dev/null | sed -n 's/^STAG_VM_FAIL=//p' | tail -n1) || why=
        [[ -f $CTL/fail ]] && why=$(<"$CTL/fail")
        if [[ -n $why ]]; then
            log "error: guest setup failed: $why"
        else
            log "error: the VM stopped without reporting an exit code (qemu exit $qrc)"
        fi
        console_tail
        exit 3
    fi
    log "kernel $K_REL ($accel): $timing, exit $rc"
    exit "$rc"
}

console_tail() {
    ((VERBOSE)) && return 0
    [[ -s $CTL/console.log ]] || return 0
    log "last lines of the guest console:"
    tail -n 40 "$CTL/console.log" | sed 's/^/  | /' >&2
}

# ---------------------------------------------------------------------------
main() {
    local series=${STAG_VM_KERNEL:-6.12} check=0 prepare=0
    TIMEOUT=600 MEM=1024 CPUS=2 VERBOSE=0 SHARES=() CMD=()
    while (($#)); do
        case $1 in
        --kernel) series=${2:?--kernel needs 6.12 or 6.1}; shift 2 ;;
        --kernel=*) series=${1#*=}; shift ;;
        --timeout) TIMEOUT=${2:?}; shift 2 ;;
        --timeout=*) TIMEOUT=${1#*=}; shift ;;
        --share) SHARES+=("$2"); shift 2 ;;
        --share=*) SHARES+=("${1#*=}"); shift ;;
        --mem) MEM=${2:?}; shift 2 ;;
        --cpus) CPUS=${2:?}; shift 2 ;;
        -v | --verbose) VERBOSE=1; shift ;;
        --check) check=1; shift ;;
        --prepare) prepare=1; shift ;;
        -h | --help) usage 0 ;;
        --) shift; CMD=("$@"); break ;;
        -*) log "unknown option $1 (see --help)"; exit 2 ;;
        *) CMD=("$@"); break ;;
        esac
    done
    [[ $TIMEOUT =~ ^[0-9]+$ && $MEM =~ ^[0-9]+$ && $CPUS =~ ^[0-9]+$ ]] ||
        { log "--timeout, --mem and --cpus take whole numbers"; exit 2; }
    ((check)) && CMD=(bash "$VM_DIR/check.sh")
    ((${#CMD[@]} || prepare)) || { log "no command given (see --help)"; exit 2; }
    local i
    for i in "${!SHARES[@]}"; do
        mkdir -p "${SHARES[$i]}" || die "cannot create share ${SHARES[$i]}"
        SHARES[i]=$(cd "${SHARES[$i]}" && pwd)
        [[ ${SHARES[$i]} != *[[:space:]]* ]] || die "share paths may not contain spaces"
    done

    CACHE=${STAG_VM_CACHE:-${XDG_CACHE_HOME:+$XDG_CACHE_HOME/stag-vm}}
    CACHE=${CACHE:-/var/cache/stag-vm}
    mkdir -p "$CACHE" || die "cannot create the cache dir $CACHE"

    # One preparer at a time per cache; concurrent runs of a warm cache only
    # hold the lock for the stamp checks.
    exec 9>"$CACHE/.lock"
    flock 9 || die "cannot lock $CACHE/.lock"
    ensure_host_packages
    QEMU=${STAG_VM_QEMU:-qemu-system-x86_64}
    command -v "$QEMU" >/dev/null || die "QEMU ($QEMU) not found"
    [[ -r /usr/share/qemu/qboot.rom ]] || die "QEMU's qboot.rom firmware is missing"
    select_kernel "$series"
    prepare_kernel
    prepare_vmlinux
    prepare_initramfs
    flock -u 9
    exec 9>&-
    ((prepare)) && { log "cache ready: $K_DIR"; ((${#CMD[@]})) || exit 0; }

    CTL=$(mktemp -d "${TMPDIR:-/tmp}/stag-vm.XXXXXX")
    trap cleanup EXIT
    trap 'log "interrupted"; exit 130' INT TERM
    make_initrd
    write_command
    run_vm
}

main "$@"
