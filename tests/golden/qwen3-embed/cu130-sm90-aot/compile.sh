#!/bin/sh
# Stage compile for qwen3-embed:cu130-sm90-aot: runs inside a container created from the exact runtime image
# digest, with the target GPU (sm_90). mopt build mounts the model at
# /opt/mopt/model (read-only, where the final image keeps it), this directory's inputs at /mopt/inputs and the output at /mopt/out.
set -eu
exec python -m mopt_runtime compile \
  --backend torch-aot \
  --device cuda \
  --model /opt/mopt/model \
  --out /mopt/out \
  --precision bf16 \
  --max-batch 512 \
  --max-seq-len 512 \
  --pooling last \
  --normalize \
  --instruction 'Given a web search query, retrieve relevant passages that answer the query' \
  --matryoshka-min-dim 32 \
  --target-sm 90 \
  --compile-mode default \
  --attention causal \
  --input packed \
  --max-batch-tokens 32768 \
  --min-cosine 0.99 \
  --image-info /mopt/inputs/image-info.json \
  --reference-texts /mopt/inputs/smoke-inputs.json
