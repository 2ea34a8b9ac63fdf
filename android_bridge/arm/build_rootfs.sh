#!/usr/bin/env bash
# Build the emulated phone: a Debian bookworm arm64 root filesystem with Python 3.11 and the
# pinned aarch64 wheels of requirements-arm64.txt, run under qemu-user (see android_bridge/arm).
#
#   android_bridge/arm/build_rootfs.sh            build into the cache unless it is up to date
#   FEDGC_ARM_CACHE=/some/dir ... build_rootfs.sh  another cache (default ~/.cache/fedgc/arm64)
#
# The cache lies outside the clone on purpose: CI clones afresh on the same machine and reuses
# it. A stamp (sha256 of this script and the requirements) decides whether the rootfs is current;
# the rootfs is built beside it and renamed into place, so an interrupted build leaves no
# half-built tree behind. qemu-user-static and debootstrap are installed with apt when missing
# (root only; otherwise the error names them).
#
# No binfmt_misc registration and no chroot: commands run as `qemu-aarch64-static -L ROOTFS`
# (android_bridge/arm/emulator.py). So nothing inside may exec another aarch64 binary, and the
# Debian packages are unpacked (dpkg-deb -x) rather than configured by debootstrap's second
# stage, which would need exactly that. Python needs no maintainer scripts.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${FEDGC_ARM_CACHE:-$HOME/.cache/fedgc/arm64}"
requirements="$here/requirements-arm64.txt"
rootfs="$cache/rootfs"
mirror="${FEDGC_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
host_python="${FEDGC_HOST_PYTHON:-python3}"
stamp_value="$(cat "$0" "$requirements" | sha256sum | cut -d' ' -f1)"

if [ -f "$rootfs/.fedgc-stamp" ] && [ "$(cat "$rootfs/.fedgc-stamp")" = "$stamp_value" ]; then
  echo "arm64 rootfs up to date: $rootfs"
  exit 0
fi

need=()
command -v qemu-aarch64-static >/dev/null || need+=(qemu-user-static)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v dpkg-deb >/dev/null || need+=(dpkg)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing ${need[*]} with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  else
    echo "error: the arm64 build needs ${need[*]} (Debian packages); install them as root:" >&2
    echo "  apt-get install ${need[*]}" >&2
    exit 1
  fi
fi
if [ "$(id -u)" != 0 ]; then
  echo "error: debootstrap needs root to build the arm64 rootfs in $rootfs" >&2
  exit 1
fi
"$host_python" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2>/dev/null || {
  echo "error: $host_python must be Python 3.11 (it downloads cp311 wheels and byte-compiles" \
       "for the rootfs's Python 3.11); set FEDGC_HOST_PYTHON" >&2
  exit 1
}

start=$(date +%s)
mkdir -p "$cache/wheels"
work="$cache/rootfs.new"
rm -rf "$work"

echo "[1/5] debootstrap (download and unpack) bookworm arm64 minbase + python3.11"
# --foreign: download every package and unpack the essential ones without running arm64 code.
debootstrap --arch=arm64 --foreign --variant=minbase --include=python3.11,python3,zlib1g \
  bookworm "$work" "$mirror" >"$cache/debootstrap.log" 2>&1 || {
  echo "error: debootstrap failed; see $cache/debootstrap.log" >&2; tail -5 "$cache/debootstrap.log" >&2
  exit 1
}
for deb in "$work"/var/cache/apt/archives/*.deb; do dpkg-deb -x "$deb" "$work"; done
rm -rf "$work"/var/cache/apt/archives/*.deb "$work"/debootstrap "$work"/usr/share/doc \
  "$work"/usr/share/man "$work"/usr/share/locale

echo "[2/5] aarch64 wheels (cached in $cache/wheels)"
# pip does not widen a --platform tag to older manylinux ones, so list them all: the NVIDIA
# wheels torch needs are manylinux_2_25/2_27, torch and executorch manylinux_2_28.
platforms=()
for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_aarch64"); done
platforms+=(--platform manylinux2014_aarch64 --platform linux_aarch64 --platform any)
pip_target=("$host_python" -m pip --disable-pip-version-check)
PIP_CONSTRAINT= "${pip_target[@]}" download -q --no-deps "${platforms[@]}" --python-version 3.11 \
  --only-binary=:all: -r "$requirements" -d "$cache/wheels"

echo "[3/5] install the wheels into /opt/fedgc/site"
PIP_CONSTRAINT= "${pip_target[@]}" install -q --no-deps --no-index --find-links "$cache/wheels" \
  "${platforms[@]}" --python-version 3.11 --only-binary=:all: --no-compile \
  --target "$work/opt/fedgc/site" -r "$requirements"

echo "[4/5] byte-compile with the host's Python 3.11 (same bytecode; 10x faster than emulated)"
"$host_python" -m compileall -q -j 0 "$work/opt/fedgc/site" "$work/usr/lib/python3.11" \
  >/dev/null 2>&1 || true

echo "[5/5] the emulated CPU's /proc/cpuinfo and sysfs"
# Under qemu-user the host's x86 /proc/cpuinfo and /sys/devices/system/cpu show through, and
# torch's cpuinfo and oneDNN (xbyak_aarch64) crash on them (a NULL dereference while importing
# torch). qemu -L serves these files from the rootfs instead: two Cortex-A76 cores (a phone big
# core, the CPU model emulator.py asks qemu for), with that core's caches.
sys_cpu="$work/sys/devices/system/cpu"
mkdir -p "$sys_cpu" "$work/proc"
for f in online possible present; do echo 0-1 >"$sys_cpu/$f"; done
echo 1 >"$sys_cpu/kernel_max"
echo >"$sys_cpu/offline"
for cpu in 0 1; do
  d="$sys_cpu/cpu$cpu"
  mkdir -p "$d/regs/identification" "$d/topology" "$d/cpufreq"
  echo 0x00000000414fd0b1 >"$d/regs/identification/midr_el1"   # Arm, r4p1, part 0xd0b (A76)
  echo 0x0000000000000000 >"$d/regs/identification/revidr_el1"
  echo 0 >"$d/topology/physical_package_id"
  for f in cluster_cpus_list package_cpus_list core_siblings_list; do echo 0-1 >"$d/topology/$f"; done
  for f in core_id thread_siblings_list core_cpus_list; do echo "$cpu" >"$d/topology/$f"; done
  echo 2600000 >"$d/cpufreq/cpuinfo_max_freq"
  echo 600000 >"$d/cpufreq/cpuinfo_min_freq"
  index=0
  # level type size shared ways sets (64-byte lines)
  for spec in "1 Data 64K $cpu 4 256" "1 Instruction 64K $cpu 4 256" "2 Unified 512K $cpu 8 1024" \
              "3 Unified 2048K 0-1 16 2048"; do
    set -- $spec
    c="$d/cache/index$index"
    mkdir -p "$c"
    echo "$1" >"$c/level"; echo "$2" >"$c/type"; echo "$3" >"$c/size"
    echo "$4" >"$c/shared_cpu_list"; echo 64 >"$c/coherency_line_size"
    echo "$5" >"$c/ways_of_associativity"; echo "$6" >"$c/number_of_sets"
    index=$((index + 1))
  done
done
for cpu in 0 1; do
  printf 'processor\t: %d\nBogoMIPS\t: 38.40\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x4\nCPU part\t: 0xd0b\nCPU revision\t: 1\n\n' "$cpu"
done >"$work/proc/cpuinfo"

echo "$stamp_value" >"$work/.fedgc-stamp"
rm -rf "$rootfs"
mv "$work" "$rootfs"
echo "arm64 rootfs built in $(( $(date +%s) - start )) s: $rootfs ($(du -sh "$rootfs" | cut -f1))"
