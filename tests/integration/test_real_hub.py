"""hf:// and modelscope:// against the real Hugging Face Hub and ModelScope (or their mirrors), where this
machine can reach them. The project's build machines cannot: there the tests skip with that reason,
and the same code runs against the local stand-ins in tests/unit/test_hub_source.py,
tests/unit/test_modelscope_source.py and tests/integration/test_hub_model.py."""
from __future__ import annotations

import pytest

from builder import hubs
from builder.hubs.huggingface import HuggingFace
from builder.hubs.modelscope import ModelScope

pytestmark = pytest.mark.integration
REPO = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture(scope="module")
def real_hub():
    found = HuggingFace.from_env()
    if found.settings.offline:
        pytest.skip("offline mode is on (HF_HUB_OFFLINE/MOPT_OFFLINE): the real Hub is not asked")
    if not hubs.reachable(found.settings):
        pytest.skip(f"{found.settings.endpoint} is unreachable from this machine; the stand-in Hub tests cover "
                    "this code")
    return found


def test_a_real_model_resolves_to_a_commit_and_downloads_what_engines_read(real_hub, tmp_path):
    snapshot = hubs.fetch(real_hub, f"{REPO}@main", tmp_path, print)
    assert len(snapshot.commit) == 40 and snapshot.source == f"hf://{REPO}@{snapshot.commit}"
    assert {"config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json"} <= set(snapshot.files)
    assert not any(name.startswith(("onnx/", "openvino/")) or name.endswith(".bin") for name in snapshot.files)
    assert hubs.card_license(snapshot.path) == "apache-2.0"
    pinned = snapshot.lock_entry()
    assert hubs.fetch(real_hub, f"{REPO}@main", tmp_path, print, pinned=pinned).commit == snapshot.commit


def test_the_flagship_model_resolves_on_modelscope(tmp_path):
    client = ModelScope.from_env()
    if client.settings.offline or not hubs.reachable(client.settings):
        pytest.skip(f"{client.settings.endpoint} is unreachable from this machine (or offline mode is on); the "
                    "stand-in ModelScope tests cover this code")
    commit = client.resolve("Qwen/Qwen3-Embedding-0.6B", "master")
    assert hubs.COMMIT.match(commit), commit
    listed = client.listed_sha256("Qwen/Qwen3-Embedding-0.6B", commit)
    assert "model.safetensors" in listed and len(listed["model.safetensors"]) == 64
