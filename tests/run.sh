#!/usr/bin/env bash
# tests/run.sh: runs dtrain's test programs and adds up their results.
#   tests/run.sh [PROGRAM...]        default: build/tests/test_*
# Each program runs from the repository root with stdin from /dev/null and a time limit of
# TEST_TIMEOUT seconds (default 600); its output is shown as it comes. The harness
# (tests/test.h) ends each program with "<file>: N passed, N failed"; this script adds those
# lines up. A program that crashes, times out, prints no summary line, or exits non-zero
# without a failed case counts as one more failure. The last line is the total,
# "N passed, N failed", and the exit status is 1 when anything failed (or nothing ran).
# The environment is passed on: DTR_TEST_QUICK=1 (set under sanitizers: slow tests shrink
# their workloads), DTR_FMNIST_DIR (Fashion-MNIST folder), ASAN_OPTIONS, UBSAN_OPTIONS.
# TEST_WRAPPER, when set, is the command each program runs under (make test-arm64:
# qemu-aarch64).
set -uo pipefail
cd "$(dirname "$0")/.."

timeout_s=${TEST_TIMEOUT:-600}
if [ $# -eq 0 ]; then
  set -- build/tests/test_*
fi

passed=0 failed=0 programs=0
problems=()
log=$(mktemp)
trap 'rm -f "$log"' EXIT

for prog in "$@"; do
  name=$(basename "$prog")
  if [ ! -x "$prog" ] || [ -d "$prog" ]; then
    echo "run.sh: $prog: no such test program" >&2
    failed=$((failed + 1)); problems+=("$name: missing")
    continue
  fi
  programs=$((programs + 1))
  echo "==== $name"
  start=$SECONDS
  timeout -k 10 "$timeout_s" ${TEST_WRAPPER:+$TEST_WRAPPER} "$prog" </dev/null 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  secs=$((SECONDS - start))

  summary=$(grep -E '^[^ ]+: [0-9]+ passed, [0-9]+ failed$' "$log" | tail -n 1)
  p=0 f=0
  if [ -n "$summary" ]; then
    p=$(echo "$summary" | sed -E 's/^[^ ]+: ([0-9]+) passed, ([0-9]+) failed$/\1/')
    f=$(echo "$summary" | sed -E 's/^[^ ]+: ([0-9]+) passed, ([0-9]+) failed$/\2/')
  fi

  why=""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    why="timed out after ${timeout_s}s"
  elif [ "$rc" -gt 128 ]; then
    why="killed by SIG$(kill -l $((rc - 128)) 2>/dev/null || echo $((rc - 128)))"
  elif [ -z "$summary" ] && [ "$rc" -ne 0 ]; then
    why="exit $rc before its summary line (crash, exit() or sanitizer report?)"
  elif [ -z "$summary" ]; then
    why="printed no summary line"
  elif [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    why="exit $rc with no failed case (sanitizer or leak report?)"
  fi
  passed=$((passed + p)); failed=$((failed + f))
  if [ -n "$why" ]; then
    # Counted as one failure unless the program already reported failed cases.
    if [ -z "$summary" ] || [ "$f" -eq 0 ]; then failed=$((failed + 1)); fi
    problems+=("$name: $why")
    echo "run.sh: $name: $why" >&2
  elif [ "$f" -gt 0 ]; then
    problems+=("$name: $f failed")
  fi
  echo "---- $name: ${secs}s, exit $rc"
done

if [ "$programs" -eq 0 ]; then
  echo "run.sh: no test programs ran" >&2
  failed=$((failed + 1)); problems+=("no test programs")
fi
if [ ${#problems[@]} -gt 0 ]; then
  echo "run.sh: problems:" >&2
  printf '  %s\n' "${problems[@]}" >&2
fi
echo "run.sh: $programs programs"
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ] && [ "$programs" -gt 0 ]
