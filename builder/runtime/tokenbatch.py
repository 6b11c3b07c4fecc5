"""Small requests' texts tokenized together, off the event loop.

A small request is parsed and checked on the event loop: a thread hop for each would cost more than the
work. Tokenizing it there too took about a third of the loop's time at 256 clients sending one text
each (docs/performance.md), and the loop is one thread whose time per request caps the requests a
second. So each small request hands its texts in here and waits for the end of the loop's turn; every
text handed in during that turn is tokenized in one encode call in a thread (the tokenizers library
releases the GIL and spreads a batch over the cores). The request then runs prepare() as before, which
finds its ids ready (TextEncoder.encode's known): every check and answer stays the same, the texts are
only tokenized earlier. A batch that fails (a text the tokenizer refuses) is tokenized again request by
request, so one bad request costs the others nothing but time; its own error comes from prepare().
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

MAX_TEXTS = 512  # a batch is sent at once when it holds this many texts (a bound on one call's time)
Known = dict[str, list[int]]


def _encode(encoder, texts: list[str]) -> Known:
    return dict(zip(texts, encoder.encode(texts), strict=True))


def _encode_batch(encoder, groups: list[list[str]]) -> list[Known]:
    """One dict of ids per group (all of them share one); a group whose texts the tokenizer refuses gets none."""
    try:
        known = _encode(encoder, list(dict.fromkeys(t for group in groups for t in group)))
        return [known] * len(groups)
    except Exception:  # noqa: BLE001 - e.g. a lone surrogate: each request again on its own
        out = []
        for group in groups:
            try:
                out.append(_encode(encoder, group))
            except Exception:  # noqa: BLE001 - that request tokenizes in prepare() and answers its 400
                out.append({})
        return out


class _Batch:
    def __init__(self, encoder):
        self.encoder = encoder
        self.waiting: list[tuple[list[str], asyncio.Future]] = []
        self.texts = 0
        self.sent = False


class TokenBatches:
    def __init__(self, max_texts: int = MAX_TEXTS):
        self.max_texts = max_texts
        # One thread: a batch runs in parallel inside the tokenizer; batches wait their turn and grow.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mopt-tokenize-batch")
        self._batch: _Batch | None = None  # the one being gathered
        self.batches = 0  # sent so far (tests read it)

    async def ids(self, encoder, texts: list[str]) -> Known:
        """Token ids of TEXTS by encoder (TextEncoder.encode(texts) for each, untruncated); {} where they
        could not be had (prepare() then tokenizes as it always did)."""
        if not texts:
            return {}
        batch = self._batch
        if batch is None or batch.encoder is not encoder:  # none open, or the service changed (loaded)
            if batch is not None:
                self._send(batch)
            batch = self._batch = _Batch(encoder)
            asyncio.get_running_loop().call_soon(self._send, batch)  # at the end of this turn
        fut = asyncio.get_running_loop().create_future()
        batch.waiting.append((texts, fut))
        batch.texts += len(texts)
        if batch.texts >= self.max_texts:
            self._send(batch)
        return await fut

    def _send(self, batch: _Batch) -> None:
        if batch.sent:
            return
        batch.sent = True
        if self._batch is batch:
            self._batch = None
        self.batches += 1
        waiting = batch.waiting
        try:
            job = self._pool.submit(_encode_batch, batch.encoder, [texts for texts, _ in waiting])
        except RuntimeError:  # closed (the server stops): the requests tokenize on their own
            _answer(waiting, None)
            return
        asyncio.wrap_future(job).add_done_callback(lambda done: _answer(waiting, done))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _answer(waiting: list[tuple[list[str], asyncio.Future]], done: asyncio.Future | None) -> None:
    failed = done is None or done.cancelled() or done.exception() is not None
    results = [{}] * len(waiting) if failed else done.result()
    for (_, fut), known in zip(waiting, results, strict=True):
        if not fut.done():  # a request cancelled meanwhile (its client left, its deadline passed)
            fut.set_result(known)
