#!/usr/bin/env bash
# scripts/cpu-scaling.sh: the CPU figures that need free cores, in one call, for a machine with
# at least 8 of them (this project's usual machine has 2 virtual CPUs, which caps what two
# ranks can reach below the targets; the GPU machines the device tool lends have 16):
#   1. bench/fmnist_dp, ZeRO-1 at world 1 and 2 with the no-sync ceiling, through the local
#      transport's shared-memory collectives (DTR_COMM_SHM=2) and through the transport
#      (communication-efficiency target: 2 ranks >= 1.6x one rank with ZeRO-1)
#   2. bench/ps: sync PS against all-reduce DP at 4 workers (target: sync <= 1.3x DP's step),
#      then one worker slowed about 2x, fixed and rotating (target: async and SSP >= 1.5x sync),
#      each also with aggregate 4 (async and SSP servers average 4 pushes per update)
#   3. bench/allreduce through the local transport at world 2 and 4 (the segment; Open MPI's
#      peer runs only where mpirun is installed: bench/run-allreduce.sh)
# Every line is JSON, kept in $OUT (default build/cpu-scaling/) and printed at the end, with
# nproc and the load average before and after. Builds what is missing (make). The data:
# $DTR_FMNIST_DIR (or the first argument), else /usr/share/datasets/fashion-mnist.
# Usage: scripts/cpu-scaling.sh [DATA_DIR]     (about 5 minutes on 16 cores)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out=${OUT:-build/cpu-scaling}
mkdir -p "$out"
data=${1:-${DTR_FMNIST_DIR:-/usr/share/datasets/fashion-mnist}}
for b in fmnist_dp ps allreduce; do
  [ -x "build/bench/$b" ] || make -j"$(nproc)" "build/bench/$b" > "$out/build.log" 2>&1 || { echo "build of $b failed" >&2; exit 1; }
done
{ echo "nproc $(nproc)"; uptime; } > "$out/machine.txt"
run() {   # run NAME COMMAND...: its JSON lines into $out/NAME.jsonl
  local name=$1; shift
  timeout 300 "$@" > "$out/$name.jsonl" 2> "$out/$name.err"
  echo "$name: $?" >> "$out/summary.txt"
}
: > "$out/summary.txt"
DTR_COMM_SHM=2 run dp-zero1-shm build/bench/fmnist_dp --data "$data" --world 1,2 --zero 1 --repeat 3 --ceiling 1
run dp-zero1 build/bench/fmnist_dp --data "$data" --world 1,2 --zero 1 --repeat 3 --ceiling 1
run ps-sync-dp build/bench/ps --data "$data" --mode sync,dp --servers 2 --workers 4 --repeat 3
run ps-straggler build/bench/ps --data "$data" --mode sync,async,ssp --servers 2 --workers 4 --straggler-ms 8 --repeat 2
run ps-rotate build/bench/ps --data "$data" --mode sync,async,ssp --servers 2 --workers 4 --straggler-ms 8 \
    --straggler rotate --repeat 2
run ps-straggler-agg build/bench/ps --data "$data" --mode sync,async,ssp --servers 2 --workers 4 --straggler-ms 8 \
    --aggregate 4 --repeat 2
run ps-rotate-agg build/bench/ps --data "$data" --mode sync,async,ssp --servers 2 --workers 4 --straggler-ms 8 \
    --straggler rotate --aggregate 4 --repeat 2
for w in 2 4; do
  DTR_COMM_SHM=2 run "allreduce-w$w" build/bench/allreduce --world "$w"
done
uptime >> "$out/machine.txt"
cat "$out/machine.txt" "$out/summary.txt"
cat "$out"/*.jsonl
