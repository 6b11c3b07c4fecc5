#!/bin/sh
# Stage compile for minilm-embed:cpu: runs inside a container created from the exact runtime image
# digest. mopt build mounts the model at
# /opt/mopt/model (read-only, where the final image keeps it), this directory's inputs at /mopt/inputs and the output at /mopt/out.
set -eu
exec python -m mopt_runtime compile \
  --backend torch-aot \
  --device cpu \
  --model /opt/mopt/model \
  --out /mopt/out \
  --precision fp32 \
  --max-batch 32 \
  --max-seq-len 256 \
  --pooling mean \
  --normalize \
  --compile-mode default \
  --input packed \
  --max-batch-tokens 8192 \
  --min-cosine 0.99 \
  --image-info /mopt/inputs/image-info.json \
  --reference-texts /mopt/inputs/smoke-inputs.json
