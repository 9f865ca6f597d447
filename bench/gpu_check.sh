#!/usr/bin/env bash
# The GPU checks of one device call: install, the GPU tests, then the MoE-layer benchmark (peers in the same run).
#   bash bench/gpu_check.sh tests [PATHS]  # pytest -m gpu (all of tests/ by default), a line per test (a call cut
#     short still says which passed), log to $OUT/gpu-tests.log
#   bash bench/gpu_check.sh layer          # bench/moe_layer.py --profile [--vllm], table to $OUT/gpu-moe-layer.md
#   bash bench/gpu_check.sh generate [ARGS] # bench/generate.py ARGS, table to $OUT/gpu-generate.md
#   bash bench/gpu_check.sh tune-quack [ARGS]   # bench/tune_quack.py: QuACK tile configurations into kernels/configs/
#   bash bench/gpu_check.sh fine-grained [ARGS] # bench/fine_grained.py ARGS, table to $OUT/fine-grained.md
#   bash bench/gpu_check.sh fp8-linear [ARGS]   # bench/fp8_linear.py ARGS, table to $OUT/fp8-linear.md
#   bash bench/gpu_check.sh direct-experts [ARGS] # bench/direct_experts.py ARGS, table to $OUT/direct-experts.md
#   bash bench/gpu_check.sh scatter-combine [ARGS] # bench/scatter_combine.py ARGS, table to $OUT/scatter-combine.md
#   bash bench/gpu_check.sh combine-tiles [ARGS] # bench/combine_tiles.py ARGS, table to $OUT/combine-tiles.md
#   bash bench/gpu_check.sh routing-kernels [ARGS] # bench/routing_kernels.py ARGS, table to $OUT/routing-kernels.md
#   bash bench/gpu_check.sh decode-attention [ARGS] # its GPU tests, the attention probe at a short and at a 4k
#     context, decode steps with and without option decode_attention (ARGS, e.g. --commit, to each generate.py)
# On the device tool's H200 machine: its python3 has torch, triton and transformers; nothing is downloaded
# (carry .whl/ with the wheels it lacks). TAG=name suffixes the output files, for several runs of a case in one call.
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${OUT:-build/gpu-check}
tag=${TAG:+-$TAG}
mkdir -p "$out"
what=${1:-tests}
shift || true
if [ -f .whlx/libs.tar.xz ] && [ ! -d /tmp/site/nvidia_cutlass_dsl ]; then  # QuACK's CuTe DSL runtime (one call's
  mkdir -p /tmp/site && tar -C /tmp/site -xJf .whlx/libs.tar.xz              # size limit: carried repacked as tar.xz)
fi
# QuACK compiles its autotuning candidates in parallel and keeps its autotuning results on disk. Their key does not
# tell weight layouts apart, so SonicMoE's go to a folder of their own (fine_grained.py --sonic-cache), which comes
# back packed as $OUT/sonic-autotune.tar.gz (the device tool returns no folder that deep): copy it to .peers/ and
# carry it, and the next run skips SonicMoE's tuning
export QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-16}
installed=/tmp/moecompile-installed  # several checks in one call install once
if ls .whl/*.whl > /dev/null 2>&1; then  # wheels the machine lacks (nvidia-cutlass: the CUTLASS FP8 headers; QuACK)
  [ -f $installed ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    > "$out/install.log" 2>&1
  export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/python_packages  # (--target skips the .pth)
fi
[ -f $installed ] || python3 -m pip install -q --no-deps --no-build-isolation --no-compile -e . >> "$out/install.log" \
  2>&1 || { tail -5 "$out/install.log"; exit 1; }
touch $installed
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
# the device's copy of .git may lag its working tree: say so, since a results header then names an older commit
git diff --quiet HEAD 2> /dev/null || echo "note: the working tree differs from HEAD $(git rev-parse --short HEAD):" \
  "pass --commit <hash> from the machine that sent it"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
case "$what" in
  tests) python3 -m pytest -v --tb=short -m gpu "${@:-tests}" -p no:cacheprovider --durations=10 2>&1 | tee "$out/gpu-tests$tag.log" ;;
  layer)  # vLLM's fused_moe as a peer when its source was fetched here and carried (.peers/)
    peer=$([ -f .peers/vllm/fused_moe.py ] && echo --vllm)
    python3 bench/moe_layer.py --profile $peer --out "$out/gpu-moe-layer$tag.md" 2>&1 | tee "$out/gpu-moe-layer$tag.log" ;;
  generate) python3 bench/generate.py --out "$out/gpu-generate$tag.md" "$@" 2>&1 | tee "$out/gpu-generate$tag.log" ;;
  tune-quack) cp kernels/configs/quack_gemm.json "$out/"  # updated there after each GEMM (a call cut short keeps it)
    python3 bench/tune_quack.py --json "$out/quack_gemm.json" --out "$out/quack-tuning$tag.md" "$@" 2>&1 \
      | tee "$out/quack-tuning$tag.log" ;;
  fine-grained)
    peer=$([ -f .peers/vllm/fused_moe.py ] && echo --vllm)
    cache=/tmp/sonic-autotune
    mkdir -p $cache
    [ -f .peers/sonic-autotune.tar.gz ] && tar -C $cache -xzf .peers/sonic-autotune.tar.gz
    python3 bench/fine_grained.py $peer --sonic-cache $cache --out "$out/fine-grained$tag.md" "$@" 2>&1 \
      | tee "$out/fine-grained$tag.log"
    tar -C $cache -czf "$out/sonic-autotune.tar.gz" . ;;
  fp8-linear) python3 bench/fp8_linear.py --out "$out/fp8-linear$tag.md" "$@" 2>&1 | tee "$out/fp8-linear$tag.log" ;;
  direct-experts) python3 bench/direct_experts.py --out "$out/direct-experts$tag.md" "$@" 2>&1 \
    | tee "$out/direct-experts$tag.log" ;;
  scatter-combine) python3 bench/scatter_combine.py --out "$out/scatter-combine$tag.md" "$@" 2>&1 \
    | tee "$out/scatter-combine$tag.log" ;;
  combine-tiles) python3 bench/combine_tiles.py --out "$out/combine-tiles$tag.md" "$@" 2>&1 \
    | tee "$out/combine-tiles$tag.log" ;;
  routing-kernels) python3 bench/routing_kernels.py --out "$out/routing-kernels$tag.md" "$@" 2>&1 \
    | tee "$out/routing-kernels$tag.log" ;;
  decode-attention)  # what decides the option's default (docs/compile-backend.md, decode_attention)
    python3 -m pytest -q -m gpu tests/test_gpu_decode_attention.py -p no:cacheprovider 2>&1 \
      | tee "$out/gpu-tests-decode-attention.log"
    python3 bench/generate.py --out "$out/decode-attention-probe-short.md" --models qwen3-30b-a3b,mixtral-8x7b \
      --modes "" --attention-probe --batches 1 --context 128 "$@" 2>&1 | tail -40
    python3 bench/generate.py --out "$out/decode-attention-probe-4k.md" --models qwen3-30b-a3b,mixtral-8x7b \
      --modes "" --attention-probe --batches 64 --context 4096 "$@" 2>&1 | tail -40
    python3 bench/generate.py --out "$out/decode-attention-steps.md" --models qwen3-30b-a3b,mixtral-8x7b \
      --batches 1,16 --modes moecompile,moecompile-split-kv --reps 2 --new 32 "$@" 2>&1 | tail -20 ;;
  *) echo "usage: bench/gpu_check.sh tests [PATHS]|layer|generate|tune-quack|fine-grained|fp8-linear|direct-experts" \
       "|scatter-combine|combine-tiles|routing-kernels|decode-attention [ARGS]" >&2
     exit 2 ;;
esac
