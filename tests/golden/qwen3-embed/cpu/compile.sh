#!/bin/sh
# Stage compile for qwen3-embed:cpu: runs inside a container created from the exact runtime image
# digest. mopt build mounts the model at
# /opt/mopt/model (read-only, where the final image keeps it), this directory's inputs at /mopt/inputs and the output at /mopt/out.
set -eu
exec python -m mopt_runtime compile \
  --backend torch-aot \
  --device cpu \
  --model /opt/mopt/model \
  --out /mopt/out \
  --precision fp32 \
  --max-batch 512 \
  --max-seq-len 512 \
  --pooling last \
  --normalize \
  --instruction 'Given a web search query, retrieve relevant passages that answer the query' \
  --matryoshka-min-dim 32 \
  --compile-mode default \
  --attention causal \
  --input packed \
  --max-batch-tokens 32768 \
  --min-cosine 0.99 \
  --image-info /mopt/inputs/image-info.json \
  --reference-texts /mopt/inputs/smoke-inputs.json
