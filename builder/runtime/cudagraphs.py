"""CUDA graphs for the small calls of a packed engine on the GPU.

A call of a few short texts costs the packed Qwen3-0.6B engine about 5 ms on the H200 whatever its
size: hundreds of kernel launches from AOTInductor's wrapper, each a few microseconds of CPU, with the
GPU waiting between them. A CUDA graph launches them all at once. Graphs have fixed shapes, so the
small calls are captured at a few sizes (SHAPES: total tokens x sequences) and a call is padded up to
the nearest one: the extra tokens go into extra sequences of their own (each at most max_seq_len
long, at least one token), which attention keeps apart from the real ones and whose pooled rows are
dropped. The longest-sequence input is captured at max_seq_len (flash attention takes it as an upper
bound). Larger calls run as they are: the GPU is busy with them anyway.

Only engines that keep sequences apart with flash attention (CUDA, fp16/bf16) are graphed; the
others' attention is gathered per call (packed.py). At load every shape is captured, and a probe call
must agree with the engine run directly, else the engine runs without graphs (a warning says why).
Opt-in: MOPT_CUDA_GRAPHS=1 (serve --cuda-graphs) turns them on (wanted() says why not by default)."""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

ENV = "MOPT_CUDA_GRAPHS"
# Up to 2,048 tokens: on the H200 (Qwen3-0.6B shape) a graph took 1.8 ms against 6.0 for one text and
# 3.9 against 6.1 for 16 (1,500 tokens), but 8.1 against 7.1 for 32 texts padded to 3,072 tokens: there
# the GPU is busy anyway and the padding costs more than the launches saved
# (benchmarks/results/served_vs_raw_h200_graphs.json, call_latency).
GRAPH_TOKENS = (128, 256, 384, 512, 768, 1024, 1536, 2048)
GRAPH_SEQUENCES = (2, 4, 8, 16, 32, 64)
# The probe's rows must agree with the direct call's this closely (cosine): padding changes nothing but
# the GEMMs' tiling, a rounding difference.
PROBE_MIN_COSINE = 0.999


def wanted() -> bool:
    """Off unless MOPT_CUDA_GRAPHS says on: the compile step's fresh-process load of an XLM-R-large engine
    with graphs was killed by SIGABRT on the H200 (cause not found: no device time left), and served they
    gained 5% at 32 x 1 (docs/performance.md run 5)."""
    return os.environ.get(ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def graph_shapes(max_batch: int, batch_tokens: int) -> list[tuple[int, int]]:
    """(tokens, sequences) captured for an engine of these limits."""
    return [(t, n) for t in GRAPH_TOKENS if t <= batch_tokens for n in GRAPH_SEQUENCES if n <= max_batch]


def fits(tokens: int, sequences: int, shape: tuple[int, int], longest: int) -> bool:
    """Whether a call fits a captured shape: the padding tokens fill the extra sequences, each with 1 to
    `longest` tokens (none when the call is exactly the shape)."""
    extra_tokens, extra_seqs = shape[0] - tokens, shape[1] - sequences
    if extra_tokens < 0 or extra_seqs < 0:
        return False
    if extra_seqs == 0:
        return extra_tokens == 0
    return extra_seqs <= extra_tokens <= extra_seqs * longest


def pick(tokens: int, sequences: int, shapes: list[tuple[int, int]], longest: int) -> tuple[int, int] | None:
    """The smallest captured shape the call fits (fewest tokens, then fewest sequences), or None."""
    fitting = [s for s in shapes if fits(tokens, sequences, s, longest)]
    return min(fitting) if fitting else None


def padding_lengths(extra_tokens: int, extra_seqs: int) -> list[int]:
    """Lengths of the padding sequences: extra_tokens spread as evenly as can be over extra_seqs."""
    if extra_seqs == 0:
        return []
    base, rest = divmod(extra_tokens, extra_seqs)
    return [base + 1] * rest + [base] * (extra_seqs - rest)


def pad_call(ids: torch.Tensor, lengths: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed call's (input_ids [1, tokens], seq_lengths [sequences]) padded to shape; the padding
    tokens are id 0 (any valid id: their sequences are dropped)."""
    tokens, sequences = ids.shape[1], lengths.shape[0]
    padded_ids = torch.zeros(1, shape[0], dtype=ids.dtype, device=ids.device)  # where the call's are (CPU or GPU)
    padded_ids[0, :tokens] = ids[0]
    extra = padding_lengths(shape[0] - tokens, shape[1] - sequences)
    padded_lengths = torch.cat([lengths, torch.tensor(extra, dtype=lengths.dtype, device=lengths.device)])
    return padded_ids, padded_lengths


class _Graph:
    __slots__ = ("graph", "ids", "lengths", "out")

    def __init__(self, graph, ids, lengths, out):
        self.graph, self.ids, self.lengths, self.out = graph, ids, lengths, out


class GraphedPackedRunner:
    """runner(input_ids, seq_lengths, max_len) on the GPU -> [sequences, dim] on the GPU, with the small
    calls replayed from CUDA graphs. Calls come one at a time (the engine's one thread).

    The graphs are captured from a model container of their own (open_runner(instances)), one model
    instance per graph: AOTInductor's container records an event at the end of each run and queries it
    before the instance runs again, and an event recorded during a capture is no real event. Each
    instance runs once, in its capture, and never again; the direct runner (another container) warms
    each shape up first and runs every call that fits no graph. The weights are held twice on the GPU."""

    def __init__(self, runner, open_runner, max_batch: int, batch_tokens: int, max_seq_len: int,
                 device: str = "cuda"):
        self.runner = runner
        self.device = device
        self.longest = max_seq_len
        self.shapes = graph_shapes(max_batch, batch_tokens)
        # Held for the graphs' life: they replay its kernels on its weights (freed with it).
        self.capture = capture = open_runner(len(self.shapes)) if self.shapes else None
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.max_len = torch.zeros(max_seq_len, dtype=torch.int8, device=device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=device)
        # Largest first: the smaller graphs reuse the pool the larger ones left (vLLM's order).
        for shape in sorted(self.shapes, reverse=True):
            tokens, sequences = shape
            ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
            lengths = torch.tensor(padding_lengths(tokens, sequences), dtype=torch.int32, device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                runner(ids, lengths, self.max_len)  # warm: the wrapper's first-call work stays out of the graph
            torch.cuda.current_stream(device).wait_stream(stream)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            # relaxed: AOTInductor's model container queries its last run's event before a run, which
            # the global mode refuses while any stream captures.
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="relaxed"):
                out = capture(ids, lengths, self.max_len)
            self.graphs[shape] = _Graph(graph, ids, lengths, out)
        torch.cuda.synchronize(device)

    def __call__(self, ids: torch.Tensor, lengths: torch.Tensor, max_len: torch.Tensor) -> torch.Tensor:
        shape = pick(ids.numel(), lengths.shape[0], self.shapes, self.longest) if ids.shape[0] == 1 else None
        if shape is None:
            return self.runner(*(t.to(self.device) for t in (ids, lengths, max_len)))
        padded_ids, padded_lengths = pad_call(ids, lengths, shape)
        g = self.graphs[shape]
        g.ids.copy_(padded_ids)
        g.lengths.copy_(padded_lengths)
        g.graph.replay()
        return g.out[:lengths.shape[0]]

    def probe(self, vocab: int = 1000, seed: int = 0) -> float:
        """The lowest cosine between the graphed and the direct call's rows over probe calls of several
        shapes (random ids below vocab)."""
        gen = torch.Generator().manual_seed(seed)
        worst = 1.0
        for lengths in ([7], [3, 17, 40, 9], [self.longest] + [5] * 6, [1] * 30):
            lens = torch.tensor([min(n, self.longest) for n in lengths], dtype=torch.int32)
            ids = torch.randint(0, vocab, (1, int(lens.sum())), generator=gen)
            max_len = torch.zeros(int(lens.max()), dtype=torch.int8)
            graphed = self(ids, lens, max_len).float()
            direct = self.runner(*(t.to(self.device) for t in (ids, lens, max_len))).float()
            cos = torch.nn.functional.cosine_similarity(graphed, direct, dim=-1)
            worst = min(worst, float(cos.min()))
        return worst


def graphed(runner, params, vocab: int, open_runner):
    """The runner with CUDA graphs where they apply and agree with it; else the runner as it is.
    open_runner(instances): another model container of the engine, for the captures."""
    from .packed import gathers_attention

    if not (params.packed and params.device == "cuda" and not gathers_attention(params.device, params.precision)
            and wanted()):
        return runner
    try:
        graphs = GraphedPackedRunner(runner, open_runner, params.max_batch, params.batch_tokens, params.max_seq_len)
        worst = graphs.probe(vocab)
    except Exception as exc:  # noqa: BLE001  (graphs are a speed-up: without them the engine still serves)
        log.warning("CUDA graphs off: capturing the engine failed (%s: %s)", type(exc).__name__, exc)
        torch.cuda.synchronize()
        return runner
    if not worst >= PROBE_MIN_COSINE:
        log.warning("CUDA graphs off: the graphed engine disagrees with the direct one (cosine %.4f)", worst)
        return runner
    return graphs
