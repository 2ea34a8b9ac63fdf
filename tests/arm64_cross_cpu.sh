#!/usr/bin/env bash
# Run the cross_cpu tests (pytest -m cross_cpu) on arm64 floats: the emulated phone's Debian
# aarch64 Python and torch under qemu-user, against the snapshots written on x86 (docs/guide.md,
# "Testing"). `make test-cross-cpu-arm64`; tens of minutes under emulation, not part of `make test`.
#
#   tests/arm64_cross_cpu.sh                      every cross_cpu test (the files that mark some)
#   tests/arm64_cross_cpu.sh tests/test_run_snapshots.py -k dgc_int8   pytest's arguments
#
# Needs the arm64 rootfs of `make arm` (FEDGC_ARM_CACHE, default ~/.cache/fedgc/arm64), which it
# only reads. The tests' own packages (Flower, pytest, scikit-learn, matplotlib...:
# android_bridge/arm/requirements-arm64-tests.txt) go beside it, in FEDGC_ARM_TEST_SITE (default
# $FEDGC_ARM_CACHE/test-site), as build_rootfs.sh installs the phone's: aarch64 wheels with
# --no-deps, byte-compiled by the host's Python 3.11 (FEDGC_HOST_PYTHON). A stamp (sha256 of
# the requirements) decides whether that folder is current.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
cache="${FEDGC_ARM_CACHE:-$HOME/.cache/fedgc/arm64}"
rootfs="$cache/rootfs"
site="${FEDGC_ARM_TEST_SITE:-$cache/test-site}"
requirements="$repo/android_bridge/arm/requirements-arm64-tests.txt"
host_python="${FEDGC_HOST_PYTHON:-python3}"
qemu_cpu=cortex-a76  # android_bridge/arm/emulator.py's QEMU_CPU, which the rootfs's sysfs describes

if [ ! -f "$rootfs/.fedgc-stamp" ] || [ ! -x "$rootfs/usr/bin/python3.11" ]; then
  echo "error: no arm64 rootfs in $rootfs; run \`make arm\` (android_bridge/arm/build_rootfs.sh)" >&2
  exit 1
fi
command -v qemu-aarch64-static >/dev/null || {
  echo "error: qemu-aarch64-static not found (Debian qemu-user-static); run \`make arm\`" >&2
  exit 1
}
case "$site" in
  "$rootfs"|"$rootfs"/*) echo "error: FEDGC_ARM_TEST_SITE=$site lies in the rootfs, which" \
                              "this script only reads" >&2; exit 1 ;;
esac

stamp_value="$(sha256sum <"$requirements" | cut -d" " -f1)"
if [ ! -f "$site/.fedgc-stamp" ] || [ "$(cat "$site/.fedgc-stamp")" != "$stamp_value" ]; then
  "$host_python" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' 2>/dev/null || {
    echo "error: $host_python must be Python 3.11 (cp311 wheels, bytecode for the rootfs's" \
         "Python 3.11); set FEDGC_HOST_PYTHON" >&2
    exit 1
  }
  echo "installing the tests' aarch64 packages into $site"
  platforms=()  # as build_rootfs.sh: pip does not widen a --platform tag to older ones
  for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_aarch64"); done
  platforms+=(--platform manylinux2014_aarch64 --platform linux_aarch64 --platform any)
  pip=("$host_python" -m pip --disable-pip-version-check)
  work="$site.new"
  rm -rf "$work"
  wheels="$(dirname "$site")/test-wheels"
  mkdir -p "$wheels"
  PIP_CONSTRAINT= "${pip[@]}" download -q --no-deps "${platforms[@]}" --python-version 3.11 \
    --only-binary=:all: -r "$requirements" -d "$wheels"
  PIP_CONSTRAINT= "${pip[@]}" install -q --no-deps --no-index --find-links "$wheels" \
    "${platforms[@]}" --python-version 3.11 --only-binary=:all: --no-compile --target "$work" \
    -r "$requirements"
  "$host_python" -m compileall -q -j 0 "$work" >/dev/null 2>&1 || true
  echo "$stamp_value" >"$work/.fedgc-stamp"
  rm -rf "$site"
  mv "$work" "$site"
fi

# pytest's temporary folders on the host's side: qemu -L serves a path from the rootfs where it
# exists there, and the rootfs has a /tmp of its own.
tmp="$(mktemp -d "${TMPDIR:-/tmp}/fedgc-arm64-cross-cpu.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
cd "$repo"
# Only the files that hold cross_cpu tests are collected: the suite's other files import what
# the emulated environment does not have (Hypothesis, TensorBoard, Ray: not needed here).
if ! printf '%s\n' "$@" | grep -q '^tests/'; then
  set -- $(grep -l 'mark.cross_cpu' tests/test_*.py) "$@"
fi
echo "arm64 (qemu-user $(qemu-aarch64-static --version | head -1 | awk '{print $3}'), -cpu $qemu_cpu):" \
     "pytest -m cross_cpu $*"
# One torch thread, as the host's tests run; the test site after the phone's packages.
env -i PATH=/usr/bin:/bin HOME="${HOME:-/root}" LANG=C.UTF-8 PYTHONHASHSEED=0 OMP_NUM_THREADS=1 \
  TMPDIR="$tmp" PYTHONPATH="/opt/fedgc/site:$site:$repo" \
  qemu-aarch64-static -cpu "$qemu_cpu" -L "$rootfs" "$rootfs/usr/bin/python3.11" \
  -m pytest -q -p no:cacheprovider --durations=20 -m cross_cpu "$@"
