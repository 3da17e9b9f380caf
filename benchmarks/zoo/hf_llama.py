"""Hugging Face `LlamaForCausalLM` from a small `LlamaConfig` (RMSNorm, SwiGLU MLP, rotary
embeddings, grouped-query attention: 4 query heads, 2 key/value heads), AdamW.

attn_implementation="sdpa" (the transformers default: torch's scaled_dot_product_attention).
No dropout (Llama's attention_dropout defaults to 0).

Peak: 1.1 M parameters (4 x 4.3 MiB with gradients and Adam state); at batch_size=8,
seq_len=256 the per-layer SwiGLU activations (8 x 256 x 344 x 3) and the (8, 256, 1024)
logits dominate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # remat loads this file stand-alone; its helpers live beside it
    sys.path.insert(0, _HERE)
import _zoo_common as zc  # noqa: E402


def build(batch_size: int = 8, seq_len: int = 256, n_layer: int = 4, hidden_size: int = 128,
          vocab_size: int = 1024, *, device="cpu", dtype=torch.float32):
    transformers = zc.import_transformers()
    config = transformers.LlamaConfig(hidden_size=hidden_size, intermediate_size=344, num_hidden_layers=n_layer,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size,
                                      max_position_embeddings=max(seq_len, 64), use_cache=False,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype)

    def batch(step: int) -> dict[str, torch.Tensor]:
        g = zc.generator(step, 2200)
        ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
        return zc.to_device({"input_ids": ids, "labels": ids.clone()}, device)

    return zc.remat.Workload(model=model, batch=batch, loss=zc.hf_loss, optimizer=zc.adamw)
