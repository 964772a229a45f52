#!/usr/bin/env bash
# bench/run-allreduce.sh: dtrain's all-reduce against Open MPI and PyTorch's gloo, on one machine.
#
#   bench/run-allreduce.sh [--world N] [--build DIR] [--min BYTES] [--max BYTES] [--iters K]
#                          [--repeat R] [--timeout SECONDS]
#   (make bench-allreduce builds what it needs and runs it; BENCH_ARGS="..." passes options)
#
# Runs, at --world N ranks (default 2), each with the same sizes and method (bench/allreduce.c):
#   local        build/bench/allreduce --world N                      (ranks are threads)
#   fabric-seg   build/dtrun -n N -- build/bench/allreduce --transport libfabric --provider shm
#                (the default: collectives through dtrain's shared-memory segment, single copy)
#   fabric-shm   the same with DTR_COMM_SHM=0: everything through libfabric's shm provider
#   fabric-tcp   the same with --provider "tcp;ofi_rxm" (and DTR_COMM_SHM=0)
#   mpi          mpirun -np N --mca btl self,vader build/bench/allreduce_mpi   (Open MPI, ob1 + vader)
#   gloo         python3 bench/allreduce_gloo.py --world N            (PyTorch gloo over TCP)
# and prints every JSON line on stdout as it comes, then a summary: busbw of each at each size,
# the ratios fabric-seg / mpi and fabric-seg / gloo, and the issue's targets. --repeat R runs
# the whole list R times in turn and the summary takes each one's best (highest busbw, lowest
# us), so that the ratios hold on a noisy machine. The targets:
#   fabric-seg busbw >= Open MPI's at every size from 1 MiB up, and >= 10x gloo's there;
#   fabric-seg latency at 4 KiB <= 5 us.
# A step whose program is missing is SKIPPED and one that fails (or runs past --timeout,
# default 600 s) is reported as FAILED, on stderr and in the summary; the others still run.
# Exit status: 0 (also when targets are missed or steps fail: read the summary); 2: bad usage.
# Environment: PYTHON (default: python3 if it has torch, else /usr/bin/python3), MPIRUN
# (default mpirun), MPI_ARGS (extra mpirun options).
# Runs as root add --allow-run-as-root to mpirun. Filter the JSON with `grep '^{'`.
set -u
cd "$(dirname "$0")/.." || exit 2

world=2 build=build timeout_s=600 repeat=1
pass=()
while [ $# -gt 0 ]; do
  case $1 in
    --world) world=${2:?--world needs a value}; shift 2 ;;
    --build) build=${2:?--build needs a value}; shift 2 ;;
    --timeout) timeout_s=${2:?--timeout needs a value}; shift 2 ;;
    --repeat) repeat=${2:?--repeat needs a value}; shift 2 ;;
    --min|--max|--iters) pass+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "run-allreduce: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
for v in "$world" "$repeat"; do
  case $v in ''|*[!0-9]*|0) echo "run-allreduce: --world and --repeat need a number >= 1" >&2; exit 2 ;; esac
done

MPIRUN=${MPIRUN:-mpirun}
bench=$build/bench/allreduce
dtrun=$build/dtrun
results=$(mktemp "${TMPDIR:-/tmp}/run-allreduce.XXXXXX")
trap 'rm -f "$results"' EXIT
notes=()

say() { echo "run-allreduce: $*" >&2; }

# step LABEL COMMAND...: runs COMMAND under timeout; JSON lines (dtrun's "[rank] " prefix taken
# off) go to stdout and, tagged with LABEL, to $results; other output goes to stderr.
step() {
  local label=$1 rc
  shift
  say "$label: $*"
  timeout -k 10 "$timeout_s" "$@" </dev/null | sed -u 's/^\[[0-9]*\] //' | while IFS= read -r line; do
    case $line in
      '{"bench":"allreduce"'*) printf '%s\n' "$line"; printf '%s\t%s\n' "$label" "$line" >>"$results" ;;
      *) printf '%s\n' "$line" >&2 ;;
    esac
  done
  rc=${PIPESTATUS[0]}
  [ "$repeat" -gt 1 ] && where=" in round $round" || where=
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "$label: FAILED$where (timed out after ${timeout_s} s)"
    notes+=("$label: FAILED$where (timed out after ${timeout_s} s)")
  elif [ "$rc" -ne 0 ]; then
    say "$label: FAILED$where (exit status $rc; its messages are above)"
    notes+=("$label: FAILED$where (exit status $rc)")
  fi
}

skip() {
  say "$1: SKIPPED ($2)"; notes+=("$1: SKIPPED ($2)")
}

# ---- the steps ----

# Which steps can run (checked once); a missing program is reported once.
have_bench=0 have_dtrun=0 have_mpi=0
if [ -x "$bench" ]; then have_bench=1; else skip local "$bench not built: make bench"; fi
if [ $have_bench = 1 ] && [ -x "$dtrun" ]; then have_dtrun=1
else for l in fabric-shm fabric-tcp; do skip $l "$bench or $dtrun not built: make bench $dtrun"; done; fi
if ! command -v "$MPIRUN" >/dev/null 2>&1; then
  skip mpi "$MPIRUN not found: make bench-deps (openmpi-bin)"
elif [ ! -x "$build/bench/allreduce_mpi" ]; then
  skip mpi "$build/bench/allreduce_mpi not built: it needs mpicc (make bench-deps, then make bench)"
else
  have_mpi=1
  # shellcheck disable=SC2054 # self,vader is one argument
  mpi_opts=(--oversubscribe -np "$world" --mca btl self,vader)
  [ "$(id -u)" -eq 0 ] && mpi_opts=(--allow-run-as-root "${mpi_opts[@]}")
fi
# PYTHON, else the first of python3 (PATH) and /usr/bin/python3 (Debian's python3-torch)
# that has torch with gloo.
has_gloo() {
  command -v "$1" >/dev/null 2>&1 && "$1" -c 'import torch.distributed as d; assert d.is_gloo_available()' 2>/dev/null
}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  has_gloo python3 || ! has_gloo /usr/bin/python3 || PYTHON=/usr/bin/python3
fi
have_gloo=0
if has_gloo "$PYTHON"; then have_gloo=1
else skip gloo "$PYTHON with PyTorch and gloo not found: make bench-deps (python3-torch)"; fi

# The whole list once per round, so that a disturbance hits one round, not one implementation.
for ((round = 1; round <= repeat; round++)); do
  [ "$repeat" -gt 1 ] && say "round $round of $repeat"
  [ $have_bench = 1 ] && step local "$bench" --world "$world" "${pass[@]}"
  if [ $have_dtrun = 1 ]; then
    # the default: dtrain's shared-memory collectives (segment, single copy above 128 KiB)
    step fabric-seg "$dtrun" -n "$world" -- "$bench" --transport libfabric --provider shm "${pass[@]}"
    for prov in shm 'tcp;ofi_rxm'; do   # everything through the provider
      step "fabric-${prov%%;*}" env DTR_COMM_SHM=0 "$dtrun" -n "$world" -- "$bench" --transport libfabric --provider "$prov" \
        "${pass[@]}"
    done
  fi
  # shellcheck disable=SC2086 # MPI_ARGS is a list of options
  [ $have_mpi = 1 ] && step mpi "$MPIRUN" "${mpi_opts[@]}" ${MPI_ARGS:-} "$build/bench/allreduce_mpi" --provider vader "${pass[@]}"
  [ $have_gloo = 1 ] && step gloo "$PYTHON" bench/allreduce_gloo.py --world "$world" "${pass[@]}"
done

# ---- the summary ----

echo
best=; [ "$repeat" -gt 1 ] && best=", best of $repeat runs"
echo "== all-reduce at world $world: busbw in GB/s per implementation$best (bench/run-allreduce.sh) =="
for n in "${notes[@]}"; do echo "   $n"; done
awk -F'\t' -v world="$world" -v cores="$(nproc 2>/dev/null || echo 0)" '
  function field(s, name,   m) {
    if (match(s, "\"" name "\":[^,}]*")) { m = substr(s, RSTART + length(name) + 3, RLENGTH - length(name) - 3); gsub(/"/, "", m); return m }
    return ""
  }
  function size(b) { return b >= 1048576 ? b / 1048576 " MiB" : b / 1024 " KiB" }
  function cell(l, b) { return ((l, b) in bw) ? sprintf("%8.3f", bw[l, b]) : sprintf("%8s", "-") }
  function ratio(l1, l2, b) {
    return ((l1, b) in bw) && ((l2, b) in bw) && bw[l2, b] > 0 ? sprintf("%7.2fx", bw[l1, b] / bw[l2, b]) : sprintf("%8s", "-")
  }
  {
    l = $1; b = field($2, "bytes") + 0
    v = field($2, "busbw_gbps") + 0; t = field($2, "us") + 0
    if (!((l, b) in bw) || v > bw[l, b]) bw[l, b] = v
    if (!((l, b) in us) || t < us[l, b]) us[l, b] = t
    if (!(b in seen)) { seen[b] = 1; sizes[++ns] = b }
  }
  END {
    if (ns == 0) { print "   no results"; exit }
    # sizes in increasing order (insertion sort: a handful of them)
    for (i = 2; i <= ns; i++) { v = sizes[i]; for (j = i - 1; j >= 1 && sizes[j] > v; j--) sizes[j + 1] = sizes[j]; sizes[j + 1] = v }
    printf "%10s %8s %8s %8s %8s %8s %8s %8s %8s\n", "size", "local", "fab-shm", "fab-seg", "fab-tcp", "mpi", "gloo", "seg/mpi", "seg/gloo"
    for (i = 1; i <= ns; i++) {
      b = sizes[i]
      printf "%10s %s %s %s %s %s %s %s %s\n", size(b), cell("local", b), cell("fabric-shm", b), cell("fabric-seg", b),
             cell("fabric-tcp", b), cell("mpi", b), cell("gloo", b), ratio("fabric-seg", "mpi", b), ratio("fabric-seg", "gloo", b)
    }
    printf "%10s", "us @4KiB"
    split("local fabric-shm fabric-seg fabric-tcp mpi gloo", L, " ")
    for (k = 1; k <= 6; k++) printf " %8s", (((L[k], 4096) in us) ? sprintf("%.1f", us[L[k], 4096]) : "-")
    printf "\n\nTargets (fab-seg = dtrain with its shared-memory collectives, the default; fab-shm = all through libfabric shm (DTR_COMM_SHM=0); world %d%s):\n", world, cores > 0 && world > cores + 0 ? sprintf(": %d ranks on %d cores, oversubscribed", world, cores) : ""
    # busbw >= mpi and >= 10x gloo at every size from 1 MiB up
    split("mpi gloo", P, " "); F[1] = 1; F[2] = 10
    for (k = 1; k <= 2; k++) {
      miss = ""; worst = ""; n = 0; ok = 1
      for (i = 1; i <= ns; i++) {
        b = sizes[i]
        if (b < 1048576) continue
        if (!(("fabric-seg", b) in bw) || !((P[k], b) in bw) || bw[P[k], b] <= 0) { ok = 0; miss = miss " " size(b) " (no result)"; continue }
        n++; r = bw["fabric-seg", b] / bw[P[k], b]
        if (worst == "" || r < worst) { worst = r; wsize = size(b) }
        if (r < F[k]) miss = miss sprintf(" %s (%.2fx)", size(b), r)
      }
      what = sprintf("busbw >= %s%s at every size from 1 MiB up", F[k] == 1 ? "" : F[k] "x ", P[k] == "mpi" ? "Open MPI" : "gloo")
      if (n == 0) printf "  %-58s n/a (no results to compare)\n", what
      else if (miss == "" && ok) printf "  %-58s PASS (lowest %.2fx, at %s)\n", what, worst, wsize
      else printf "  %-58s FAIL at:%s\n", what, miss
    }
    what = "latency at 4 KiB <= 5 us"
    if (("fabric-seg", 4096) in us) printf "  %-58s %s (%.1f us)\n", what, us["fabric-seg", 4096] <= 5 ? "PASS" : "FAIL", us["fabric-seg", 4096]
    else printf "  %-58s n/a (no fabric-seg result at 4 KiB)\n", what
  }' "$results"
exit 0
