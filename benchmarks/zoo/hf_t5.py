"""Hugging Face `T5ForConditionalGeneration` from a small `T5Config`: encoder-decoder with
cross-attention, relative position bias, RMS-style T5LayerNorm, ReLU MLP, dropout 0.1, AdamW.

attn_implementation="eager" (T5's attention module has its own implementation).

Peak: 1.6 M parameters (4 x 6.2 MiB with gradients and Adam state); at batch_size=8,
src_len=128, tgt_len=128 the encoder self-attention, decoder self- and cross-attention maps
(8 x 4 x 128 x 128 per layer, with dropout masks) and the (8, 128, 1024) logits dominate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # remat loads this file stand-alone; its helpers live beside it
    sys.path.insert(0, _HERE)
import _zoo_common as zc  # noqa: E402


def build(batch_size: int = 8, src_len: int = 128, tgt_len: int = 128, n_layer: int = 3, d_model: int = 128,
          vocab_size: int = 1024, *, device="cpu", dtype=torch.float32):
    transformers = zc.import_transformers()
    config = transformers.T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=d_model // 4, d_ff=4 * d_model,
                                   num_layers=n_layer, num_decoder_layers=n_layer, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, use_cache=False,
                                   attn_implementation="eager")
    model = transformers.T5ForConditionalGeneration(config).to(device=device, dtype=dtype)

    def batch(step: int) -> dict[str, torch.Tensor]:
        g = zc.generator(step, 2400)
        src = torch.randint(1, vocab_size, (batch_size, src_len), generator=g)
        tgt = torch.randint(1, vocab_size, (batch_size, tgt_len), generator=g)
        lengths = torch.randint(src_len // 2, src_len + 1, (batch_size,), generator=g)
        attention_mask = (torch.arange(src_len)[None, :] < lengths[:, None]).long()
        return zc.to_device({"input_ids": src * attention_mask, "attention_mask": attention_mask,
                             "labels": tgt}, device)   # decoder inputs: labels shifted right by the model

    return zc.remat.Workload(model=model, batch=batch, loss=zc.hf_loss, optimizer=zc.adamw)
