#!/usr/bin/env bash
# scripts/run-fuzz.sh: runs libFuzzer targets built by the Makefile (`make fuzz`, `make fuzz-smoke`).
#   scripts/run-fuzz.sh run SECONDS BUILDDIR TARGET...   fuzz each target for SECONDS
#   scripts/run-fuzz.sh smoke 0 BUILDDIR TARGET...       run each target over its corpus once
# The corpus of target fuzz_NAME is tests/fuzz/corpus/fuzz_NAME/ (or tests/fuzz/corpus/NAME/).
# It is only read: new inputs go to BUILDDIR/work/<target>/ and crashes, leaks and timeouts to
# BUILDDIR/artifacts/<target>-*. Exits 1 when any target failed.
set -uo pipefail
mode=$1 seconds=$2 dir=$3
shift 3
if [ $# -eq 0 ]; then echo "run-fuzz: no fuzz targets (tests/fuzz/fuzz_*.c)"; exit 0; fi

failed=()
for bin in "$@"; do
  name=$(basename "$bin")
  corpus=tests/fuzz/corpus/$name
  [ -d "$corpus" ] || corpus=tests/fuzz/corpus/${name#fuzz_}
  # The first folder receives new inputs: a scratch one for smoke runs (which run the committed
  # corpus only), a kept one for fuzzing runs.
  if [ "$mode" = smoke ]; then work=$dir/smoke/$name; rm -rf "$work"; else work=$dir/work/$name; fi
  mkdir -p "$work" "$dir/artifacts"
  dirs=("$work")
  [ -d "$corpus" ] && dirs+=("$corpus")
  opts=(-artifact_prefix="$dir/artifacts/$name-" -rss_limit_mb=2048 -timeout=25)
  if [ "$mode" = smoke ]; then
    echo "== fuzz-smoke $name over ${corpus}"
    [ -d "$corpus" ] || echo "   (no corpus: runs the empty input only)"
    # -runs=0 executes the inputs of the corpus folders and stops.
    "$bin" "${opts[@]}" -runs=0 "${dirs[@]}" </dev/null >"$dir/$name.log" 2>&1
  else
    echo "== fuzz $name for ${seconds}s over ${dirs[*]}"
    "$bin" "${opts[@]}" -max_total_time="$seconds" -print_final_stats=1 "${dirs[@]}" </dev/null \
      >"$dir/$name.log" 2>&1
  fi
  rc=$?
  grep -E '^(#[0-9]+[[:space:]]+(INITED|DONE)|stat::number_of_executed_units)' "$dir/$name.log" | tail -3 | sed 's/^/   /'
  if [ $rc -ne 0 ]; then
    echo "   FAILED (exit $rc); log: $dir/$name.log" >&2
    tail -40 "$dir/$name.log" >&2
    failed+=("$name")
  fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "run-fuzz: ${#failed[@]} of $# targets failed: ${failed[*]}" >&2
  exit 1
fi
echo "run-fuzz: $# targets ok"
