#!/usr/bin/env bash
# scripts/gpu-check.sh: everything this version asks of a GPU machine, in one call, for the
# sessions that get one (the device tool runs it in the repository root):
#   1. build the CUDA unit, the GPU test program and bench/gpu (make -j, nvcc sm_80 + sm_90)
#   2. make test-gpu: every op case forward and backward on the GPU against the CPU
#   3. tests/test_nccl (the NCCL transport opens a world of one on the GPU)
#   4. compute-sanitizer memcheck over the GPU test programs, racecheck over the fused
#      attention kernels (when it is installed)
#   5. bench/gpu and bench/gpu_torch.py (JSON lines; PyTorch eager and compiled), the GPTs
#      with bf16 products (and bf16 activations: --bf16-act) beside torch.autocast, LoRA
#      fine-tuning's memory with and without DTR_CUDA_VMM=0 beside PyTorch's, captured
#      steps (--graph: CUDA graphs), bench/gpu_gemm beside bench/gpu_gemm_torch.py (the
#      GPTs' linear layers) and bench/gpu_attention beside bench/gpu_attention_torch.py (their
#      causal attention: the fused kernels in bf16 against scaled_dot_product_attention),
#      bench/gpu_generate beside bench/generate_torch.py (decoding through a KV cache)
#   6. when Fashion-MNIST is there: examples/fmnist_ps --gpu (GPU workers, CPU servers),
#      examples/fmnist_mlp --gpu (the loader's pinned batches; --graph, --bf16) and
#      examples/fmnist_dp --gpu --graph (2 ranks, captured data-parallel steps), a few hundred
#      steps each
# Logs go to $OUT (default: build/gpu-check/); a step that fails does not stop the others; the
# exit status is that of step 2 (0 when it was not asked for).
# Usage: scripts/gpu-check.sh [--quick] [--only LIST]
#   --quick  5 bench steps (20 otherwise) and memcheck's programs 120 s each (300 otherwise)
#   --only   a comma-separated subset of: tests (1-3), memcheck (4), bench (5), examples (6),
#            so that a session with little device time splits the run over calls that each
#            fit the device tool's limit: `--only tests` first (fix what it finds), then
#            `--only bench,examples`, then `--only memcheck` (step 1 always runs: make is quick
#            when nothing changed)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu-check}
mkdir -p "$out"
: > "$out/summary.txt"
steps=20 mc_limit=300 only=tests,memcheck,bench,examples
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) steps=5 mc_limit=120 ;;
    --only) only=$2; shift ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
want() { case ",$only," in *",$1,"*) return 0 ;; esac; return 1; }
rc=0
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
make -j"$(nproc)" lib cuda build/tests/gpu/test_grad_gpu build/tests/gpu/test_train_gpu build/tests/gpu/test_tp_gpu build/tests/gpu/test_comm_gpu build/tests/gpu/test_graph_gpu build/tests/gpu/test_cuemu build/bench/gpu build/bench/gpu_gemm build/bench/gpu_attention build/bench/gpu_generate build/tests/test_nccl examples-gpu > "$out/build.log" 2>&1
echo "build: $?" | tee -a "$out/summary.txt"
if want tests; then
  make test-gpu > "$out/test-gpu.log" 2>&1
  rc=$?
  echo "test-gpu: $rc" | tee -a "$out/summary.txt"
  tests/run.sh build/tests/test_nccl > "$out/test-nccl.log" 2>&1
  echo "test_nccl: $?" | tee -a "$out/summary.txt"
fi
if want memcheck && command -v compute-sanitizer >/dev/null 2>&1; then
  mc=0
  : > "$out/memcheck.log"
  for t in test_grad_gpu test_train_gpu test_tp_gpu test_comm_gpu test_graph_gpu; do
    timeout "$mc_limit" compute-sanitizer --tool memcheck --error-exitcode 9 build/tests/gpu/$t >> "$out/memcheck.log" 2>&1 || mc=$?
  done
  echo "memcheck: $mc" | tee -a "$out/summary.txt"
  : > "$out/racecheck.log"
  # racecheck (shared-memory hazards) over the fused attention kernels: forward and backward
  # of the small GPT's shape (head width 64), bf16 tiles, then f32 tiles (three TF32 products)
  rc=0
  for mode in --bf16 ""; do
    timeout "$mc_limit" compute-sanitizer --tool racecheck --error-exitcode 9 build/bench/gpu_attention $mode --shape gpt \
      --iters 1 --rounds 1 >> "$out/racecheck.log" 2>&1 || rc=$?
  done
  echo "racecheck: $rc" | tee -a "$out/summary.txt"
fi
if want bench; then
timeout 300 build/bench/gpu --steps "$steps" > "$out/bench-dtrain.jsonl" 2> "$out/bench-dtrain.err"
echo "bench dtrain: $?" | tee -a "$out/summary.txt"
timeout 300 python3 bench/gpu_torch.py --steps "$steps" > "$out/bench-torch.jsonl" 2> "$out/bench-torch.err"
echo "bench torch: $?" | tee -a "$out/summary.txt"
# the GPTs with bf16 products (dtrain) beside torch.autocast(bfloat16) eager
for m in gpt gpt2; do
  timeout 120 build/bench/gpu --steps "$steps" --model $m --bf16 >> "$out/bench-dtrain.jsonl" 2>> "$out/bench-dtrain.err"
  timeout 120 build/bench/gpu --steps "$steps" --model $m --bf16 --bf16-act >> "$out/bench-dtrain.jsonl" 2>> "$out/bench-dtrain.err"
  timeout 120 python3 bench/gpu_torch.py --steps "$steps" --model $m --bf16 --no-compile >> "$out/bench-torch.jsonl" 2>> "$out/bench-torch.err"
done
# LoRA fine-tuning (frozen bodies: their gradients take no device memory, cuda_memory.cu), with
# and without the driver's virtual memory calls, beside the same adapters in PyTorch
for m in gpt gpt2; do
  timeout 120 build/bench/gpu --steps "$steps" --model $m --lora 8 >> "$out/bench-dtrain.jsonl" 2>> "$out/bench-dtrain.err"
  DTR_CUDA_VMM=0 timeout 120 build/bench/gpu --steps "$steps" --model $m --lora 8 >> "$out/bench-dtrain.jsonl" 2>> "$out/bench-dtrain.err"
  timeout 120 python3 bench/gpu_torch.py --steps "$steps" --model $m --lora 8 --no-compile >> "$out/bench-torch.jsonl" 2>> "$out/bench-torch.err"
done
# captured steps (CUDA graphs) beside the eager lines above, f32 and TF32
for m in mlp cnn gpt; do
  timeout 120 build/bench/gpu --steps "$steps" --model $m --graph >> "$out/bench-dtrain.jsonl" 2>> "$out/bench-dtrain.err"
  timeout 120 build/bench/gpu --steps "$steps" --model $m --graph --tf32 >> "$out/bench-dtrain.jsonl" 2>> "$out/bench-dtrain.err"
done
# the GPTs' matrix products beside F.linear: f32, TF32, bf16 (issue: within 10% of PyTorch)
for mode in "" --tf32 --bf16; do
  timeout 120 build/bench/gpu_gemm --iters 10 --rounds 3 $mode >> "$out/bench-dtrain.jsonl" 2>> "$out/bench-dtrain.err"
  timeout 120 python3 bench/gpu_gemm_torch.py --iters 10 --rounds 3 $mode >> "$out/bench-torch.jsonl" 2>> "$out/bench-torch.err"
done
# the same with bf16 activations: 16-bit operands as stored (cuda_gemm.cu, linear16); torch: the --bf16 lines
timeout 120 build/bench/gpu_gemm --iters 10 --rounds 3 --bf16 --bf16-act >> "$out/bench-dtrain.jsonl" 2>> "$out/bench-dtrain.err"
# the GPTs' causal attention in bf16, f32 and TF32: the fused kernels (cuda_attention.cu), then the tiled ones
for mode in --bf16 "" --tf32; do
  timeout 120 build/bench/gpu_attention --iters 10 --rounds 3 $mode >> "$out/bench-dtrain.jsonl" 2>> "$out/bench-dtrain.err"
  DTR_CUDA_FLASH=0 timeout 120 build/bench/gpu_attention --iters 10 --rounds 3 $mode >> "$out/bench-dtrain.jsonl" 2>> "$out/bench-dtrain.err"
  timeout 120 python3 bench/gpu_attention_torch.py --iters 10 --rounds 3 $mode >> "$out/bench-torch.jsonl" 2>> "$out/bench-torch.err"
done
# generation through the KV cache (and without one) beside PyTorch's cache of tensors
timeout 180 build/bench/gpu_generate --backend cuda --repeat 2 >> "$out/bench-dtrain.jsonl" 2>> "$out/bench-dtrain.err"
timeout 180 python3 bench/generate_torch.py --backend cuda --repeat 2 >> "$out/bench-torch.jsonl" 2>> "$out/bench-torch.err"
fi
fm=${DTR_FMNIST_DIR:-/usr/share/datasets/fashion-mnist}
if want examples && [ -d "$fm" ]; then
  timeout 120 build/examples/gpu/fmnist_ps "$fm" --gpu --epochs 1 --max-steps 100 > "$out/fmnist-ps-gpu.log" 2>&1
  echo "fmnist_ps --gpu: $?" | tee -a "$out/summary.txt"
  timeout 120 build/examples/gpu/fmnist_mlp "$fm" --gpu --epochs 1 > "$out/fmnist-mlp-gpu.log" 2>&1
  echo "fmnist_mlp --gpu: $?" | tee -a "$out/summary.txt"
  timeout 120 build/examples/gpu/fmnist_mlp "$fm" --gpu --graph --epochs 1 > "$out/fmnist-mlp-gpu-graph.log" 2>&1
  echo "fmnist_mlp --gpu --graph: $?" | tee -a "$out/summary.txt"
  timeout 120 build/examples/gpu/fmnist_mlp "$fm" --gpu --bf16 --epochs 1 > "$out/fmnist-mlp-gpu-bf16.log" 2>&1
  echo "fmnist_mlp --gpu --bf16: $?" | tee -a "$out/summary.txt"
  timeout 120 build/examples/gpu/fmnist_dp "$fm" --gpu --graph --world 2 --epochs 1 > "$out/fmnist-dp-gpu-graph.log" 2>&1
  echo "fmnist_dp --gpu --graph: $?" | tee -a "$out/summary.txt"
fi
cat "$out/bench-dtrain.jsonl" "$out/bench-torch.jsonl" 2>/dev/null
exit $rc
