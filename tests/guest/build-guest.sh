#!/usr/bin/env bash
# Build a tiny qemu guest (Debian's own kernel + a busybox initramfs) whose
# root filesystem is the HOST's root, shared read-only over virtio-9p and made
# writable with an overlayfs on tmpfs.  Everything the guest runs (ipvsadm,
# ipset, iptables, ip, a cargo-built test binary ...) comes from the host.
#
# Usage: build-guest.sh [OUT_DIR]      (default: target/ipvs-guest)
# Env:   KERNEL_PKG=linux-image-6.1.0-56-amd64   pin the kernel package
#        (default: whatever the linux-image-amd64 metapackage depends on)
#
# Host packages needed (Debian 12 bookworm):
#   apt-get install -y --no-install-recommends qemu-system-x86 busybox-static cpio kmod \
#       ipvsadm ipset iptables iproute2
set -euo pipefail

OUT=${1:-target/ipvs-guest}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
t0=$(date +%s%N)
ts() { local ms=$(( ($(date +%s%N) - t0) / 1000000 )); printf '[%3d.%03ds] %s\n' $((ms/1000)) $((ms%1000)) "$*"; }

for tool in apt-get dpkg-deb depmod modprobe cpio busybox qemu-system-x86_64; do
  command -v "$tool" >/dev/null || { echo "missing host tool: $tool" >&2; exit 1; }
done

# ---- 1. kernel package -------------------------------------------------------
if [ -z "${KERNEL_PKG:-}" ]; then
  # the metapackage always points at the current ABI (versioned packages are
  # removed from the mirror after point releases, so never hard-code one)
  KERNEL_PKG=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
fi
[ -n "$KERNEL_PKG" ] || { echo "cannot resolve kernel package (run apt-get update?)" >&2; exit 1; }
KVER=${KERNEL_PKG#linux-image-}
KROOT=$OUT/kroot-$KVER          # extracted package: boot/ lib/modules/$KVER

if [ -f "$OUT/stamp" ] && [ "$(cat "$OUT/stamp")" = "$KERNEL_PKG" ] \
   && [ -f "$OUT/initramfs.cpio" ] && [ -f "$OUT/vmlinuz" ] && [ -d "$KROOT/lib/modules/$KVER" ]; then
  ts "guest already built for $KERNEL_PKG ($OUT)"; exit 0
fi

mkdir -p "$OUT/debs"
if ! ls "$OUT/debs/${KERNEL_PKG}"_*.deb >/dev/null 2>&1; then
  ts "downloading $KERNEL_PKG"
  # apt-get download as root warns that _apt cannot write here; harmless.
  # A stale apt list may name a .deb the mirror no longer has: update, retry.
  (cd "$OUT/debs" && apt-get download -q "$KERNEL_PKG") 2>&1 | grep -v '^W: Download is performed unsandboxed' || true
  if ! ls "$OUT/debs/${KERNEL_PKG}"_*.deb >/dev/null 2>&1; then
    apt-get update -qq
    (cd "$OUT/debs" && apt-get download -q "$KERNEL_PKG") 2>&1 | grep -v '^W: Download is performed unsandboxed' || true
  fi
fi
DEB=$(ls "$OUT/debs/${KERNEL_PKG}"_*.deb | head -1)
[ -f "$DEB" ] || { echo "download of $KERNEL_PKG failed" >&2; exit 1; }
ts "have $(basename "$DEB") ($(du -h "$DEB" | cut -f1))"

# ---- 2. extract kernel + modules (only the parts a network test needs) -------
rm -rf "$KROOT"; mkdir -p "$KROOT"
dpkg-deb --fsys-tarfile "$DEB" | tar -x -C "$KROOT" \
  --wildcards "./boot/vmlinuz-*" "./boot/config-*" \
  "./lib/modules/$KVER/modules.*" \
  "./lib/modules/$KVER/kernel/net/*" \
  "./lib/modules/$KVER/kernel/fs/9p/*" "./lib/modules/$KVER/kernel/fs/netfs/*" \
  "./lib/modules/$KVER/kernel/fs/fscache/*" "./lib/modules/$KVER/kernel/fs/overlayfs/*" \
  "./lib/modules/$KVER/kernel/drivers/virtio/*" \
  "./lib/modules/$KVER/kernel/drivers/net/veth.ko" "./lib/modules/$KVER/kernel/drivers/net/dummy.ko" \
  "./lib/modules/$KVER/kernel/drivers/net/macvlan.ko" "./lib/modules/$KVER/kernel/drivers/net/ipvlan/*" \
  "./lib/modules/$KVER/kernel/drivers/net/vxlan/*" "./lib/modules/$KVER/kernel/drivers/net/geneve.ko" \
  "./lib/modules/$KVER/kernel/drivers/net/tun.ko" \
  "./lib/modules/$KVER/kernel/crypto/*" "./lib/modules/$KVER/kernel/lib/*" \
  "./lib/modules/$KVER/kernel/arch/x86/crypto/*"
# the .deb ships no modules.dep (its postinst runs depmod); generate it.
# (warnings about unknown symbols of drivers we did not extract are harmless)
depmod -b "$KROOT" "$KVER"
cp "$KROOT/boot/vmlinuz-$KVER" "$OUT/vmlinuz"
ts "extracted kernel $KVER + modules ($(du -sh "$KROOT" | cut -f1))"

# ---- 3. initramfs: busybox + the modules needed to mount the 9p root ---------
IR=$OUT/initramfs; rm -rf "$IR"
mkdir -p "$IR"/{bin,sbin,proc,sys,dev,mods,lower,upper,newroot,lib/modules}
cp /bin/busybox "$IR/bin/busybox"
for a in sh mount umount insmod mkdir cat echo sleep poweroff chroot ln sync; do
  ln -s busybox "$IR/bin/$a"
done
: > "$IR/mods/order"
for m in virtio_pci 9pnet_virtio 9p overlay; do
  modprobe -d "$KROOT" -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}'
done | awk '!seen[$0]++' | while read -r ko; do
  b=$(basename "$ko"); cp "$ko" "$IR/mods/$b"; echo "$b" >> "$IR/mods/order"
done
# kernel module auto-loading (request_module -> /sbin/modprobe) runs in the
# initramfs root, not in our chroot: forward it to the host's kmod in the chroot
cat > "$IR/sbin/modprobe" <<'EOF'
#!/bin/sh
exec /bin/chroot /newroot /sbin/modprobe "$@"
EOF
chmod +x "$IR/sbin/modprobe"
cp "$(dirname "$0")/guest-init.sh" "$IR/init"; chmod +x "$IR/init"
(cd "$IR" && find . | cpio -o -H newc --quiet) > "$OUT/initramfs.cpio"
echo "$KERNEL_PKG" > "$OUT/stamp"
echo "$KROOT/lib/modules" > "$OUT/kmods-path"
ts "initramfs: $(du -h "$OUT/initramfs.cpio" | cut -f1), modules: $(tr '\n' ' ' < "$IR/mods/order")"
ts "done: $OUT"
