#!/bin/sh
# Stage compile for qwen3-embed:cu130-sm90-aot-debian: runs inside a container created from the exact runtime image
# digest, with the target GPU (sm_90). mopt build mounts the model at
# /opt/mopt/model (read-only, where the final image keeps it), this directory's inputs at /mopt/inputs and the output at /mopt/out.
# The engine parameters are params.json beside this script (builder/runtime/params.py, the one contract).
set -eu
exec python -m mopt_runtime compile \
  --params /mopt/inputs/params.json \
  --model /opt/mopt/model \
  --out /mopt/out \
  --target-sm 90 \
  --min-cosine 0.99 \
  --image-info /mopt/inputs/image-info.json \
  --reference-texts /mopt/inputs/smoke-inputs.json
