#!/usr/bin/env bash
# tests/cmake_consumer/check.sh: installs dtrain and builds AND runs consumer programs the ways
# a user would (`make cmake-consumer`, part of `make check`). main.c uses the core library;
# comm_main.c the libfabric transport (libdtrain_comm; only when pkg-config finds libfabric).
#   1. add_subdirectory(../.. dtrain)                          (CMake builds dtrain; DTRAIN_COMM)
#   2. `make install PREFIX=<fresh prefix>`, then from that prefix, with no LD_LIBRARY_PATH:
#      cc ... $(pkg-config --cflags --libs dtrain) and dtrain-comm, and find_package(dtrain
#      COMPONENTS comm) with the static (default) and the shared libraries (DTRAIN_USE_SHARED)
#   3. `make install DESTDIR=... PREFIX=/opt/dtrain` (a staged package): pkg-config and
#      find_package straight from the staging tree (both are relocatable)
#   4. find_package and pkg-config against `cmake --install` of the CMake build of step 1
#   5. `make uninstall` removes every installed file, from both prefixes
#   tests/cmake_consumer/check.sh [WORKDIR]       (default build/cmake_consumer)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
work=${1:-build/cmake_consumer}
mkdir -p "$work"
work=$(cd "$work" && pwd)
rm -rf "${work:?}"/*
gen=()
command -v ninja >/dev/null 2>&1 && gen=(-G Ninja)
jobs=$(nproc 2>/dev/null || echo 2)
unset LD_LIBRARY_PATH PKG_CONFIG_SYSROOT_DIR
have_pc=0; command -v pkg-config >/dev/null 2>&1 && have_pc=1
comm=OFF; [ "$have_pc" = 1 ] && pkg-config --exists libfabric && comm=ON
have_cmake=0; command -v cmake >/dev/null 2>&1 && have_cmake=1
[ "$have_cmake" = 1 ] || echo "*** cmake not found: CMake consumer checks SKIPPED (apt-get install cmake) ***"
[ "$have_pc" = 1 ] || echo "*** pkg-config not found: pkg-config checks SKIPPED (apt-get install pkgconf) ***"
[ "$comm" = ON ] || echo "*** libfabric not found: libdtrain_comm consumer checks SKIPPED (libfabric-dev) ***"

step() { echo "== cmake-consumer: $*"; }
fail() { echo "cmake-consumer: FAILED: $*" >&2; exit 1; }
quiet() {  # runs a command, showing its output only when it fails
  local log=$work/last.log
  if ! "$@" >"$log" 2>&1; then cat "$log" >&2; fail "$*"; fi
}
# run PROGRAM: runs a consumer (the comm one twice: with DTR_FABRIC_SIGNALS=keep, and with
# cfg.fabric.keep_signal_handlers; it checks that its own signal handlers survive)
run() {
  if [[ $1 == *comm* ]]; then
    DTR_FABRIC_SIGNALS=keep "$1" && env -u DTR_FABRIC_SIGNALS "$1" --keep-signals
  else "$1"; fi || fail "$1"
}
# cmake_consumer DIR PREFIX [CMAKE ARGS]: find_package(dtrain) build in DIR, then run
cmake_consumer() {
  local dir=$1 prefix=$2; shift 2
  [ "$have_cmake" = 1 ] || return 0
  quiet cmake "${gen[@]}" -S "$here" -B "$dir" -DCMAKE_BUILD_TYPE=Debug -DDTRAIN_CONSUMER_MODE=package \
    -DCMAKE_PREFIX_PATH="$prefix" -DDTRAIN_CONSUMER_COMM="$comm" "$@"
  quiet cmake --build "$dir" -j "$jobs"
  run "$dir/consumer"
  [ "$comm" = OFF ] || run "$dir/comm_consumer"
}
# pc_consumer PCDIR NAME: cc with pkg-config from PCDIR, then run (no LD_LIBRARY_PATH)
pc_consumer() {
  local pcdir=$1 name=$2 src=main.c pkg=dtrain flags
  [ "$have_pc" = 1 ] || return 0
  if [ "$name" = comm ]; then [ "$comm" = ON ] || return 0; src=comm_main.c; pkg=dtrain-comm; fi
  flags=$(PKG_CONFIG_PATH=$pcdir pkg-config --cflags --libs $pkg) || fail "pkg-config $pkg in $pcdir"
  echo "   pkg-config --cflags --libs $pkg: $flags"
  mkdir -p "$work/pc"
  # shellcheck disable=SC2086
  cc "$here/$src" -o "$work/pc/$name" $flags || fail "cc $src with pkg-config $pkg"
  readelf -d "$work/pc/$name" | grep -F "libdtrain.so" >/dev/null || fail "$name did not link libdtrain.so"
  run "$work/pc/$name"
}

if [ "$have_cmake" = 1 ]; then
  step "1. add_subdirectory (DTRAIN_COMM=$comm)"
  quiet cmake "${gen[@]}" -S "$here" -B "$work/subdir" -DCMAKE_BUILD_TYPE=Debug -DDTRAIN_CONSUMER_MODE=subdir \
    -DDTRAIN_SOURCE_DIR="$root" -DDTRAIN_INSTALL=ON -DDTRAIN_COMM="$comm" -DDTRAIN_CONSUMER_COMM="$comm"
  quiet cmake --build "$work/subdir" -j "$jobs"
  run "$work/subdir/consumer"
  [ "$comm" = OFF ] || run "$work/subdir/comm_consumer"
fi

fresh=$work/prefix
step "2. make install PREFIX=$fresh (a fresh prefix)"
quiet make -C "$root" --no-print-directory install PREFIX="$fresh"
[ "$comm" = OFF ] || [ -f "$fresh/lib/libdtrain_comm.so" ] || fail "make install did not install libdtrain_comm"
pc_consumer "$fresh/lib/pkgconfig" core
pc_consumer "$fresh/lib/pkgconfig" comm
cmake_consumer "$work/fresh-static" "$fresh"
cmake_consumer "$work/fresh-shared" "$fresh" -DDTRAIN_USE_SHARED=ON

step "3. make install DESTDIR=$work/stage PREFIX=/opt/dtrain (a staged package)"
stage=$work/stage
quiet make -C "$root" --no-print-directory install DESTDIR="$stage" PREFIX=/opt/dtrain
pc_consumer "$stage/opt/dtrain/lib/pkgconfig" core
cmake_consumer "$work/stage-static" "$stage/opt/dtrain"

if [ "$have_cmake" = 1 ]; then
  step "4. find_package and pkg-config against cmake --install of the CMake build"
  quiet cmake --install "$work/subdir" --prefix "$work/cmake-prefix"
  cmake_consumer "$work/cmake-package" "$work/cmake-prefix"
  [ "$have_pc" = 0 ] || {
    # CMake's build is static: dtrain.pc lists what libdtrain.a needs in Libs.
    flags=$(PKG_CONFIG_PATH=$work/cmake-prefix/lib/pkgconfig pkg-config --cflags --libs dtrain)
    # shellcheck disable=SC2086
    cc "$here/main.c" -o "$work/consumer-cmake-pc" $flags || fail "cc with CMake's dtrain.pc"
    run "$work/consumer-cmake-pc"
  }
fi

step "5. make uninstall"
quiet make -C "$root" --no-print-directory uninstall DESTDIR="$stage" PREFIX=/opt/dtrain
quiet make -C "$root" --no-print-directory uninstall PREFIX="$fresh"
left=$(find "$stage" "$fresh" -type f -o -type l)
[ -z "$left" ] || { echo "$left" >&2; fail "make uninstall left files behind"; }
echo "cmake-consumer: all checks passed"
