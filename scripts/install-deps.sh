#!/usr/bin/env bash
# scripts/install-deps.sh: installs the Debian packages dtrain's tests or benchmarks need.
#   scripts/install-deps.sh [test|bench]     (default: test; `make deps` / `make bench-deps`)
#     test   compilers and tools, zlib, libfabric, stb, OpenBLAS, clang with its sanitizer and
#            libFuzzer runtime, the AArch64 cross compiler and qemu-user (make test-arm64), and
#            the Fashion-MNIST data set
#     bench  the test set plus what only the benchmarks need: PyTorch and Open MPI
# A machine that has everything does nothing (dpkg-query only, no network). When something is
# missing: as root, or with passwordless sudo, `apt-get update` once and `apt-get install`
# (non-interactive; a package that cannot be installed is reported and skipped); otherwise it
# prints the packages to install and exits 0, and the build goes on with what is there (the
# Makefile says loudly what it skips). Fashion-MNIST without root: scripts/fetch-fmnist.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-test}
TEST_PKGS=(g++ pkgconf cmake zlib1g-dev libfabric-dev libfabric-bin libstb-dev libopenblas-dev
           dataset-fashion-mnist clang libclang-rt-14-dev gcc-aarch64-linux-gnu libc6-dev-arm64-cross
           qemu-user)
BENCH_PKGS=(python3-torch libopenmpi-dev openmpi-bin)
case $mode in
  test)  want=("${TEST_PKGS[@]}") ;;
  bench) want=("${TEST_PKGS[@]}" "${BENCH_PKGS[@]}") ;;
  *) echo "usage: $0 [test|bench]" >&2; exit 2 ;;
esac

installed() {
  case "$(dpkg-query -W -f='${db:Status-Abbrev}' "$1" 2>/dev/null)" in ii*) return 0 ;; *) return 1 ;; esac
}

missing=()
for p in "${want[@]}"; do installed "$p" || missing+=("$p"); done

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
  else
    SUDO=none
  fi
  if [ "${SUDO[*]}" = none ]; then
    echo "install-deps: missing Debian packages (not root, no passwordless sudo):" >&2
    echo "    sudo apt-get install ${missing[*]}" >&2
    echo "install-deps: continuing with what is there." >&2
  else
    export DEBIAN_FRONTEND=noninteractive
    apt=("${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -y -q -o DPkg::Lock::Timeout=300)
    echo "install-deps: installing ${missing[*]}"
    "${apt[@]}" update || echo "install-deps: apt-get update failed; trying with the lists there are" >&2
    if ! "${apt[@]}" install --no-install-recommends "${missing[@]}" </dev/null; then
      # One by one, so that one unavailable package does not block the others.
      for p in "${missing[@]}"; do
        installed "$p" || "${apt[@]}" install --no-install-recommends "$p" </dev/null ||
          echo "install-deps: WARNING: could not install $p" >&2
      done
    fi
    still=()
    for p in "${missing[@]}"; do installed "$p" || still+=("$p"); done
    if [ ${#still[@]} -gt 0 ]; then
      echo "install-deps: WARNING: still missing: ${still[*]} (the build skips what needs them)" >&2
    fi
  fi
fi

# The data set: Debian's package, or a copy fetched into ~/.cache without root.
if ! scripts/fetch-fmnist.sh --find >/dev/null; then
  scripts/fetch-fmnist.sh >/dev/null ||
    echo "install-deps: WARNING: Fashion-MNIST not available; the demo and the tests that need it will say so" >&2
fi
exit 0
