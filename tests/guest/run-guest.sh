#!/usr/bin/env bash
# Boot the guest built by build-guest.sh and run a script inside it.
# Usage: run-guest.sh GUEST_DIR SCRIPT [TIMEOUT_SECONDS]
# The script runs as root in the guest, with the host's root filesystem
# (read-only lower layer + tmpfs overlay), cwd = a fresh job dir that is shared
# read-write with the host.  Exit status = the script's exit status
# (124 = timeout, 125 = the guest never reported a status).
set -euo pipefail
GUEST=$(cd "$1" && pwd); SCRIPT=$2; TIMEOUT=${3:-300}
JOB=$(mktemp -d /tmp/ipvs-job.XXXXXX)
cp "$SCRIPT" "$JOB/run.sh"
[ -n "${KEEP_JOB:-}" ] || trap 'rm -rf "$JOB"' EXIT
KMODS=$(cat "$GUEST/kmods-path")
# /dev/kvm is only usable for a stock kernel when the host runs a real KVM
# (kvm_intel/kvm_amd).  This workplace's VMs expose PVM (kvm_pvm), which runs
# only PVM-enabled guest kernels: a Debian kernel hangs right after
# "Probing EDD" with no output.  Use TCG there.  Override: GUEST_ACCEL=kvm|tcg
ACCEL_MODE=${GUEST_ACCEL:-auto}
if [ "$ACCEL_MODE" = auto ]; then
  if [ -w /dev/kvm ] && [ -d /sys/module/kvm_intel -o -d /sys/module/kvm_amd ]; then ACCEL_MODE=kvm; else ACCEL_MODE=tcg; fi
fi
case $ACCEL_MODE in
  # -arch-capabilities: qemu 7.2 aborts with "failed to set MSR 0x10a" otherwise
  kvm) ACCEL="-accel kvm -cpu host,-arch-capabilities" ;;
  tcg) ACCEL="-accel tcg,thread=multi -cpu max" ;;
esac

start=$(date +%s%N)
set +e
timeout --foreground -k 5 "$TIMEOUT" qemu-system-x86_64 $ACCEL -m 2048 -smp 2 \
  -nodefaults -no-user-config -display none -no-reboot \
  -serial file:"$JOB/console.log" -monitor none \
  -nic none \
  -kernel "$GUEST/vmlinuz" -initrd "$GUEST/initramfs.cpio" \
  -append "console=ttyS0 quiet loglevel=3 panic=-1 mitigations=off ipvs_job=$JOB ipvs_kmods=$KMODS" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path="$JOB",mount_tag=job,security_model=none,multidevs=remap \
  </dev/null
qrc=$?
set -e
end=$(date +%s%N)
cat "$JOB/console.log"
ms=$(( (end - start) / 1000000 ))
printf 'guest wall time: %d.%03ds (qemu exit %d, accel %s)\n' $((ms/1000)) $((ms%1000)) "$qrc" "$ACCEL_MODE"
if [ "$qrc" = 124 ]; then echo "TIMEOUT" >&2; exit 124; fi
if [ -f "$JOB/rc" ]; then rc=$(cat "$JOB/rc"); else rc=125; fi
exit "$rc"
