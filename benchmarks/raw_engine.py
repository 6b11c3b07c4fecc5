"""The raw engine inside an image on image_bench's workload: what the server is measured against.

    .venv/bin/python benchmarks/image_bench.py --dump-workload /tmp/work.json
    docker cp benchmarks/raw_engine.py CONTAINER:/tmp/ && docker cp /tmp/work.json CONTAINER:/tmp/
    docker exec CONTAINER sh -c 'python /tmp/raw_engine.py < /tmp/work.json'

Opens the image's engine (MOPT_ENGINE_DIR, as serve does) in this process and embeds the workload's
texts: all at once (the engine cuts its calls), and in batches of the engine's max_batch as the
server's batcher gives them; words/s of 3 rounds each. Runs on the image's own Python and runtime.
"""
import json
import os
import sys
import time

os.environ.setdefault("PYTORCH_JIT", "0")  # as serve's worker
from mopt_runtime.engine import Engine  # noqa: E402

requests = json.load(sys.stdin)
texts = [text for request in requests for text in request]
words = sum(len(text.split()) for text in texts)
engine = Engine.open(os.environ.get("MOPT_ENGINE_DIR", "/opt/mopt/engine"))
engine.embed_texts(texts[:64])
rows = engine.params.max_batch
result = {"texts": len(texts), "words": words, "max_batch": rows, "all_at_once_words_s": [],
          f"batches_of_{rows}_words_s": []}
for _ in range(3):
    t = time.perf_counter()
    engine.embed_texts(texts)
    result["all_at_once_words_s"].append(round(words / (time.perf_counter() - t)))
    t = time.perf_counter()
    for i in range(0, len(texts), rows):
        engine.embed_texts(texts[i:i + rows])
    result[f"batches_of_{rows}_words_s"].append(round(words / (time.perf_counter() - t)))
print(json.dumps(result))
