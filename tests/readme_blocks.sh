#!/usr/bin/env bash
# tests/readme_blocks.sh: every ```c block of README.md compiles, and every block with a main()
# is linked against dtrain.h alone (cc block.c -lm -lpthread, as the README says) and runs,
# exiting 0, in a scratch folder. A block without main() is compiled as a translation unit.
#   tests/readme_blocks.sh [OUTDIR]     (default build/readme_blocks; `make readme-check`)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/readme_blocks}
cc=${CC:-cc}
rm -rf "$out" && mkdir -p "$out"
root=$(pwd)

# Writes block_<n>.c for each ```c ... ``` block (n from 1), with a #line pointing at README.md.
awk -v out="$out" '
  /^```c[[:space:]]*$/ { n++; f = sprintf("%s/block_%d.c", out, n); printf "#line %d \"README.md\"\n", NR + 1 > f; inb = 1; next }
  /^```/ && inb { inb = 0; close(f); next }
  inb { print > f }
' README.md

blocks=("$out"/block_*.c)
[ -e "${blocks[0]}" ] || { echo "readme_blocks: no C block found in README.md" >&2; exit 1; }
for f in "${blocks[@]}"; do
  name=$(basename "$f" .c)
  if grep -q 'main(' "$f"; then
    "$cc" -std=c99 -Wall -Wextra -Werror -O1 -I"$root" "$f" -o "$out/$name" -lm -lpthread
    (cd "$out" && "./$name") || { echo "readme_blocks: README.md $name ran and failed" >&2; exit 1; }
    echo "readme_blocks: $name built and ran"
  else
    "$cc" -std=c99 -Wall -Wextra -Werror -I"$root" -c "$f" -o "$out/$name.o"
    echo "readme_blocks: $name compiled"
  fi
done
echo "readme_blocks: ${#blocks[@]} C blocks of README.md checked"
