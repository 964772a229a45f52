#!/usr/bin/env bash
# scripts/fetch-fmnist.sh: prints the folder that holds the four Fashion-MNIST IDX files
# (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte,
# t10k-labels-idx1-ubyte, each plain or .gz).
#   scripts/fetch-fmnist.sh          find it, or fetch it when it is not there (no root needed)
#   scripts/fetch-fmnist.sh --find   find only: prints nothing and exits 1 when it is not there
# Looks in $DTR_FMNIST_DIR, /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist),
# then ~/.cache/dtrain/fashion-mnist. Fetching takes Debian's package itself:
# `apt-get download dataset-fashion-mnist` and `dpkg -x` into ~/.cache/dtrain/fashion-mnist.
set -euo pipefail

FILES=(train-images-idx3-ubyte train-labels-idx1-ubyte t10k-images-idx3-ubyte t10k-labels-idx1-ubyte)
PKG_DIR=usr/share/datasets/fashion-mnist   # where Debian's package puts the files
SYSTEM_DIR=/$PKG_DIR
CACHE_DIR="${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/dtrain/fashion-mnist"

has_files() {
  local f
  for f in "${FILES[@]}"; do
    [ -s "$1/$f.gz" ] || [ -s "$1/$f" ] || return 1
  done
}

for d in "${DTR_FMNIST_DIR:-}" "$SYSTEM_DIR" "$CACHE_DIR"; do
  if [ -n "$d" ] && has_files "$d"; then echo "$d"; exit 0; fi
done
[ "${1:-}" = "--find" ] && exit 1

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-fmnist: fetching Debian's dataset-fashion-mnist into $CACHE_DIR" >&2
if ! (cd "$tmp" && apt-get download dataset-fashion-mnist >&2); then
  echo "fetch-fmnist: apt-get download failed (no package lists? as root: apt-get update)" >&2
  exit 1
fi
dpkg -x "$tmp"/dataset-fashion-mnist_*.deb "$tmp/root"
mkdir -p "$CACHE_DIR"
cp "$tmp/root/$PKG_DIR"/* "$CACHE_DIR"/
has_files "$CACHE_DIR" || { echo "fetch-fmnist: the package lacks the expected files" >&2; exit 1; }
echo "$CACHE_DIR"
