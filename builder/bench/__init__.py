"""mopt bench: QPS at a p99 target and the latency/throughput curve of embeddings servers, side by
side, from one tool (docs/bench.md).

workload.py  what each request holds (seeded; written to the result so a run repeats)
api.py       OpenAI's /v1/embeddings and TEI's /embed: bodies, and every answer checked
target.py    a URL (loopback or --allow-host) or an image started hardened and removed after
load.py      closed-loop clients and open-loop arrivals (asyncio + aiohttp), bounded
sweep.py     the highest rate whose p99 stays under a target (bisection under the closed-loop peak)
hostload.py  the host's CPU use before and after each target
run.py       each target in turn; progress.py what it shows meanwhile; output.py table, JSON, chart
"""
