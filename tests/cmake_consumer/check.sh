#!/usr/bin/env bash
# tests/cmake_consumer/check.sh: builds and runs the consumer project four ways (`make cmake-consumer`):
#   1. add_subdirectory(../.. dtrain)                                 (CMake builds dtrain)
#   2. find_package(dtrain) against `make install DESTDIR=... PREFIX=...` (CMAKE_PREFIX_PATH)
#   3. cc main.c $(pkg-config --cflags --libs dtrain) against the same staging tree
#   4. find_package(dtrain) and pkg-config against `cmake --install` of the CMake build of step 1
# then checks that `make uninstall` removes every installed file.
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

if ! command -v cmake >/dev/null 2>&1; then
  echo "*** cmake not found: CMake consumer checks SKIPPED (apt-get install cmake) ***"
  exit 0
fi

step() { echo "== cmake-consumer: $*"; }
quiet() {  # runs a command, showing its output only when it fails
  local log=$work/last.log
  if ! "$@" >"$log" 2>&1; then cat "$log" >&2; echo "cmake-consumer: FAILED: $*" >&2; exit 1; fi
}

step "1. add_subdirectory"
quiet cmake "${gen[@]}" -S "$here" -B "$work/subdir" -DCMAKE_BUILD_TYPE=Debug \
  -DDTRAIN_CONSUMER_MODE=subdir -DDTRAIN_SOURCE_DIR="$root" -DDTRAIN_INSTALL=ON
quiet cmake --build "$work/subdir" -j "$jobs"
"$work/subdir/consumer"

step "2. find_package against make install DESTDIR=$work/stage PREFIX=/opt/dtrain"
stage=$work/stage
quiet make -C "$root" --no-print-directory install DESTDIR="$stage" PREFIX=/opt/dtrain
prefix=$stage/opt/dtrain
quiet cmake "${gen[@]}" -S "$here" -B "$work/package" -DCMAKE_BUILD_TYPE=Debug \
  -DDTRAIN_CONSUMER_MODE=package -DCMAKE_PREFIX_PATH="$prefix"
quiet cmake --build "$work/package" -j "$jobs"
"$work/package/consumer"

step "3. pkg-config"
mkdir -p "$work/pc"
if command -v pkg-config >/dev/null 2>&1; then
  export PKG_CONFIG_PATH=$prefix/lib/pkgconfig PKG_CONFIG_SYSROOT_DIR=$stage
  flags=$(pkg-config --cflags --libs dtrain)
  echo "   pkg-config --cflags --libs dtrain: $flags"
  # shellcheck disable=SC2086
  cc "$here/main.c" -o "$work/pc/consumer" $flags
  LD_LIBRARY_PATH=$prefix/lib "$work/pc/consumer"
  readelf -d "$work/pc/consumer" | grep -F "libdtrain.so" >/dev/null ||
    { echo "cmake-consumer: the pkg-config build did not link libdtrain.so" >&2; exit 1; }
  unset PKG_CONFIG_PATH PKG_CONFIG_SYSROOT_DIR
else
  echo "*** pkg-config not found: pkg-config check SKIPPED (apt-get install pkgconf) ***"
fi

step "4. find_package against cmake --install of the CMake build"
quiet cmake --install "$work/subdir" --prefix "$work/cmake-prefix"
quiet cmake "${gen[@]}" -S "$here" -B "$work/cmake-package" -DCMAKE_BUILD_TYPE=Debug \
  -DDTRAIN_CONSUMER_MODE=package -DCMAKE_PREFIX_PATH="$work/cmake-prefix"
quiet cmake --build "$work/cmake-package" -j "$jobs"
"$work/cmake-package/consumer"
if command -v pkg-config >/dev/null 2>&1; then
  # CMake's dtrain.pc is relocatable (${pcfiledir}): no sysroot needed.
  flags=$(PKG_CONFIG_PATH=$work/cmake-prefix/lib/pkgconfig pkg-config --cflags --libs dtrain)
  # shellcheck disable=SC2086
  cc "$here/main.c" -o "$work/pc/consumer-cmake" $flags
  "$work/pc/consumer-cmake"
fi

step "5. make uninstall"
quiet make -C "$root" --no-print-directory uninstall DESTDIR="$stage" PREFIX=/opt/dtrain
left=$(find "$stage" -type f -o -type l)
if [ -n "$left" ]; then
  echo "cmake-consumer: make uninstall left files behind:" >&2
  echo "$left" >&2
  exit 1
fi
echo "cmake-consumer: all checks passed"
