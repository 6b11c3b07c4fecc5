"""A loaded engine: tokenizer + compiled callable + the shape policy (buckets, batch splits)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import fingerprint
from .backends import backend_info, dense_packing, get_backend
from .params import SEQ_BUCKET, EngineParams
from .tokenization import TextEncoder


def engine_encoder(out_dir: str | Path, params: EngineParams) -> TextEncoder:
    """The tokenizer shipped in an engine dir, padding the way the engine's params say."""
    engine_dir = Path(out_dir) / fingerprint.ENGINE_SUBDIR
    return TextEncoder(engine_dir, params.pooling, params.instruction, params.pad_left)


def bucket_len(n: int, max_seq_len: int) -> int:
    # Round up to a multiple of SEQ_BUCKET (>= 2: the export's lower bound), capped at max_seq_len.
    return min(max(SEQ_BUCKET, -(-n // SEQ_BUCKET) * SEQ_BUCKET), max_seq_len)


# What one more engine call costs, in padded tokens: a fixed cost per call (launches, the wrapper,
# padding the inputs) over the engine's time per token. On the CPU a call costs about as much as a
# few dozen tokens, so a batch of mixed lengths is best cut into calls of similar lengths; on a GPU
# a call costs ~5 ms (batch-1 latency on the H200), thousands of tokens, so batches stay whole
# unless their lengths differ a lot.
CALL_COST_TOKENS = {"cpu": 32, "cuda": 2048}
UNPADDED_CALL_COST = 1 << 40  # a backend that drops padding itself: as few calls as max_batch allows


def plan_calls(lengths: list[int], max_rows: int, max_seq_len: int, call_cost: int) -> list[tuple[int, int]]:
    """Cut sequences sorted by length into engine calls [start, end) of at most max_rows, with the
    least padded tokens plus call_cost per call (a shortest path over the cut points: exact, and
    O(len * max_rows))."""
    n = len(lengths)
    best = [0] + [None] * n  # best[end]: the least cost of calls covering lengths[:end]
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        padded = bucket_len(lengths[end - 1], max_seq_len)  # sorted: the call's longest is its last
        for start in range(max(0, end - max_rows), end):
            cost = best[start] + (end - start) * padded + call_cost
            if best[end] is None or cost < best[end]:
                best[end], cut[end] = cost, start
    calls, end = [], n
    while end > 0:
        calls.append((cut[end], end))
        end = cut[end]
    return calls[::-1]


def pack_calls(lengths: list[int], max_rows: int, max_tokens: int) -> list[tuple[int, int]]:
    """Cut sequences (sorted by length) into packed engine calls [start, end): each as full as the token
    budget and the row cap allow. Sorted, so a call's sequences are of similar lengths (where attention
    is gathered per sequence, packed.py, its block is as long as the call's longest)."""
    calls, start, tokens = [], 0, 0
    for end, n in enumerate(lengths):
        if end > start and (end - start == max_rows or tokens + n > max_tokens):
            calls.append((start, end))
            start, tokens = end, 0
        tokens += n
    if start < len(lengths):
        calls.append((start, len(lengths)))
    return calls


@dataclass
class Engine:
    DEATH = "the engine's own process exited"  # what the server logs when alive() turns False (vLLM's EngineCore)

    params: EngineParams
    encoder: TextEncoder
    run: object  # callable(input_ids, attention_mask) -> float32 tensor [batch, dim]
    info: dict

    @classmethod
    def open(cls, out_dir: str | Path, params: EngineParams | None = None) -> Engine:
        return cls.from_info(out_dir, fingerprint.read(out_dir), params)

    @classmethod
    def from_info(cls, out_dir: str | Path, info: dict, params: EngineParams | None = None) -> Engine:
        params = params or EngineParams.from_dict(info["params"])
        if params.device == "cuda":
            import torch

            # A GPU engine's CPU work is small copies and index writes. With intra-op threads each one
            # wakes OpenMP's pool, whose threads then spin (measured on a 16-core H200 host: 15 threads at
            # about 50% CPU each), taking the cores the HTTP process and its clients need.
            torch.set_num_threads(1)
        run = get_backend(params.backend).load(Path(out_dir) / fingerprint.ENGINE_SUBDIR, params)
        return cls(params, engine_encoder(out_dir, params), run, info)

    @property
    def dim(self) -> int:
        return int(self.info["embedding_dim"])

    def alive(self) -> bool:
        """False once a backend's own engine process (vLLM's EngineCore) has exited; always True for engines
        that run in this process."""
        probe = getattr(self.run, "alive", None)
        return probe is None or bool(probe())

    @property
    def exitcode(self) -> int | None:
        """The backend's engine process's exit code once it has exited (vllm); None otherwise."""
        probe = getattr(self.run, "exitcode", None)
        return probe() if probe is not None else None

    @property
    def concurrent_calls(self) -> bool:
        return backend_info(self.params.backend).concurrent_calls

    def kill(self) -> None:
        """End a stalled engine at once where the backend can (vLLM: its calls fail, EngineCore gets
        SIGKILL); an engine that runs in this process has nothing to kill."""
        stop = getattr(self.run, "kill", None)
        if stop is not None:
            stop()

    def close(self, timeout: float = 10.0) -> None:  # noqa: ARG002  (in-process: nothing to wait for)
        stop = getattr(self.run, "close", None)
        if stop is not None:
            stop()

    def embed_ids(self, seqs: list[list[int]]) -> list[list[float]]:
        return self.embed_tensor(seqs).tolist()

    def embed_tensor(self, seqs: list[list[int]]):
        """float32 CPU tensor [len(seqs), dim], rows in input order."""
        import torch

        too_long = [i for i, s in enumerate(seqs) if len(s) > self.params.max_seq_len]
        if too_long:
            raise ValueError(f"inputs {too_long} exceed the engine's max_seq_len {self.params.max_seq_len}")
        if not seqs:  # the batcher's idle ping: an engine process of the backend's own answers it from there
            ping = getattr(self.run, "ping", None)
            if ping is not None:
                ping()
            return torch.empty(0, self.dim, dtype=torch.float32)
        direct = getattr(self.run, "embed_ids", None)
        if direct is not None:  # the backend takes the sequences as they are (vLLM: no padding to undo)
            return direct(seqs)
        out = torch.empty(len(seqs), self.dim, dtype=torch.float32)
        # Sorted by length and cut into calls of similar lengths (plan_calls): padding stays small.
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        lengths = [len(seqs[i]) for i in order]
        if self.params.packed:
            from .packed import gathers_attention, pack

            p = self.params
            dense = dense_packing(p)
            # Attention gathered per sequence costs what it costs padded to the call's longest: cut
            # where padding would (plan_calls); the other layers see only real tokens either way.
            groups = (plan_calls(lengths, p.max_batch, p.max_seq_len, CALL_COST_TOKENS[p.device])
                      if gathers_attention(p.device, p.precision) else [(0, len(lengths))])
            for first, last in groups:
                for start, end in pack_calls(lengths[first:last], p.max_batch, p.batch_tokens):
                    idx = order[first + start:first + end]
                    out[idx] = self.run(*pack([seqs[i] for i in idx], dense))
            return out
        cost = (UNPADDED_CALL_COST if backend_info(self.params.backend).unpadded
                else CALL_COST_TOKENS.get(self.params.device, CALL_COST_TOKENS["cuda"]))
        for start, end in plan_calls(lengths, self.params.max_batch, self.params.max_seq_len, cost):
            idx = order[start:end]
            length = bucket_len(lengths[end - 1], self.params.max_seq_len)
            batch = self.encoder.pad([seqs[i] for i in idx], length)
            emb = self.run(torch.tensor(batch.input_ids, dtype=torch.long),
                           torch.tensor(batch.attention_mask, dtype=torch.long))
            out[idx] = emb[:len(idx)]
        return out

    def embed_texts(self, texts: list[str], query: bool = False) -> list[list[float]]:
        if query:
            texts = [self.encoder.format_query(t) for t in texts]
        return self.embed_ids(self.encoder.encode(texts))
