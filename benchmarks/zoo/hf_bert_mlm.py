"""Hugging Face `BertForMaskedLM` from a small `BertConfig` (post-norm encoder, GELU, dropout 0.1),
masked-LM loss on 15% of the tokens, padded batches (attention_mask), AdamW.

attn_implementation="sdpa" (the transformers default).

Peak: 1.1 M parameters (4 x 4.3 MiB with gradients and Adam state); at batch_size=16,
seq_len=128 the per-layer activations (16 x 128 x 512 in the MLP, dropout masks) and the
(16, 128, 1024) prediction scores dominate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # remat loads this file stand-alone; its helpers live beside it
    sys.path.insert(0, _HERE)
import _zoo_common as zc  # noqa: E402

MASK_ID = 3


def build(batch_size: int = 16, seq_len: int = 128, n_layer: int = 4, hidden_size: int = 128,
          vocab_size: int = 1024, *, device="cpu", dtype=torch.float32):
    transformers = zc.import_transformers()
    config = transformers.BertConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=n_layer,
                                     num_attention_heads=4, intermediate_size=4 * hidden_size,
                                     max_position_embeddings=max(seq_len, 64), attn_implementation="sdpa")
    model = transformers.BertForMaskedLM(config).to(device=device, dtype=dtype)

    def batch(step: int) -> dict[str, torch.Tensor]:
        g = zc.generator(step, 2300)
        ids = torch.randint(10, vocab_size, (batch_size, seq_len), generator=g)
        lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=g)
        attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()   # (B, T), 0 = padding
        ids = ids * attention_mask                                                    # pad id 0
        masked = (torch.rand(batch_size, seq_len, generator=g) < 0.15) & attention_mask.bool()
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        inputs = torch.where(masked, torch.full_like(ids, MASK_ID), ids)
        return zc.to_device({"input_ids": inputs, "attention_mask": attention_mask, "labels": labels}, device)

    return zc.remat.Workload(model=model, batch=batch, loss=zc.hf_loss, optimizer=zc.adamw)
