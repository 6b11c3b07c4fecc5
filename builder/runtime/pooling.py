"""The exported module: a Hugging Face encoder/decoder body + pooling (+ L2 norm) in one graph."""
from __future__ import annotations

import torch
from torch import nn


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    if pooling == "cls":
        return hidden[:, 0]
    if pooling == "last":
        # Index of the last real token; works for left and right padding alike.
        positions = torch.arange(mask.shape[1], device=mask.device).unsqueeze(0)
        last = (positions * mask).argmax(dim=1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)


class EmbeddingModule(nn.Module):
    def __init__(self, body: nn.Module, pooling: str, normalize: bool, left_padded: bool):
        super().__init__()
        self.body = body
        self.pooling = pooling
        self.normalize = normalize
        self.left_padded = left_padded

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        kwargs = {}
        if self.left_padded:
            # Positions count real tokens only, so a padded row embeds like the unpadded text.
            kwargs["position_ids"] = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        out = self.body(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        emb = pool(out.last_hidden_state, attention_mask, self.pooling).float()
        if self.normalize:
            emb = torch.nn.functional.normalize(emb, p=2.0, dim=-1)
        return emb


def attention_implementation(attention: str) -> str:
    """transformers' attn_implementation for an engine's attention: mask | causal
    (causal_attention.py) | packed (packed.py), registering ours."""
    from . import packed
    from .causal_attention import attn_implementation

    return packed.register() if attention == "packed" else attn_implementation(attention)


def load_body(model_dir: str, dtype: torch.dtype, device: str, attention: str = "mask") -> nn.Module:
    """attention: mask | causal (causal_attention.py) | packed (packed.py)."""
    from transformers import AutoModel

    from .causal_attention import check_causal

    model = AutoModel.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention_implementation(attention))
    if attention == "causal":
        check_causal(model)
    return model.eval().to(device)
