#!/bin/sh
# /init of the guest initramfs (busybox sh, PID 1).
# Kernel command line parameters understood:
#   ipvs_job=/abs/dir    host dir shared read-write as 9p tag "job"; contains run.sh
#   ipvs_kmods=/abs/dir  host dir holding lib/modules/<uname -r> of the guest kernel
export PATH=/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev

die() { echo "IPVS-GUEST-INIT-FAILED: $*"; sync; poweroff -f; sleep 5; }

while read -r m; do insmod "/mods/$m" || die "insmod $m"; done < /mods/order

JOB= ; KMODS=
for arg in $(cat /proc/cmdline); do
  case "$arg" in
    ipvs_job=*) JOB=${arg#ipvs_job=} ;;
    ipvs_kmods=*) KMODS=${arg#ipvs_kmods=} ;;
  esac
done
[ -n "$JOB" ] && [ -n "$KMODS" ] || die "missing ipvs_job= / ipvs_kmods= on the kernel command line"

O9P=trans=virtio,version=9p2000.L,msize=512000
# host root, read-only, page cache allowed (host files do not change while we run)
mount -t 9p -o "$O9P,ro,cache=loose" hostroot /lower || die "mount hostroot"
mount -t tmpfs -o mode=755 tmpfs /upper || die "tmpfs"
mkdir -p /upper/u /upper/w
mount -t overlay -o lowerdir=/lower,upperdir=/upper/u,workdir=/upper/w overlay /newroot \
  || die "overlay"
R=/newroot
mount -t proc proc $R/proc
mount -t sysfs sysfs $R/sys
mount -t devtmpfs devtmpfs $R/dev
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts -o newinstance,ptmxmode=0666 devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
# /tmp is NOT a fresh tmpfs: the overlay already makes it writable and the
# host's /tmp (job dir, maybe the kernel modules) must stay visible.
mount -t tmpfs tmpfs $R/run
mount -t cgroup2 cgroup2 $R/sys/fs/cgroup 2>/dev/null
mount -t bpf bpf $R/sys/fs/bpf 2>/dev/null
mount -t debugfs debugfs $R/sys/kernel/debug 2>/dev/null
# guest kernel's modules at the standard place (the host has none: /lib/modules
# may not even exist there, the overlay lets us create it)
mkdir -p $R/usr/lib/modules
mount --bind "$R$KMODS" $R/usr/lib/modules || die "bind modules"
# the job dir, writable, at the same path as on the host
mount -t 9p -o "$O9P,cache=none" job "$R$JOB" || die "mount job"

echo "IPVS-GUEST-BOOTED uptime=$(cut -d" " -f1 /proc/uptime)s"
chroot $R /bin/sh -c "cd '$JOB' && exec /bin/sh ./run.sh" < /dev/console > /dev/console 2>&1
rc=$?
echo "$rc" > "$R$JOB/rc"
echo "IPVS-GUEST-RC=$rc"
sync
umount "$R$JOB" 2>/dev/null
poweroff -f
sleep 10
