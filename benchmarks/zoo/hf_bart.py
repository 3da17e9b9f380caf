"""Hugging Face `BartForConditionalGeneration` from a small `BartConfig`: encoder-decoder whose
decoder layers hold the twins `self_attn`/`encoder_attn` (both `BartAttention`), post-norm,
GELU, dropout 0.1, padded source batches, AdamW.

attn_implementation="eager".

Peak: at batch_size=8, src_len=64, tgt_len=64 the decoder's self- and cross-attention maps
(8 x 4 x 64 x 64 per layer, with dropout masks), the MLPs (8 x 64 x 512) and the (8, 64, 1024)
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


def build(batch_size: int = 8, src_len: int = 64, tgt_len: int = 64, n_layer: int = 2, d_model: int = 128,
          vocab_size: int = 1024, *, device="cpu", dtype=torch.float32):
    transformers = zc.import_transformers()
    config = transformers.BartConfig(vocab_size=vocab_size, d_model=d_model, encoder_layers=n_layer,
                                     decoder_layers=n_layer, encoder_attention_heads=4, decoder_attention_heads=4,
                                     encoder_ffn_dim=4 * d_model, decoder_ffn_dim=4 * d_model,
                                     max_position_embeddings=max(src_len, tgt_len, 64), use_cache=False,
                                     attn_implementation="eager")
    model = transformers.BartForConditionalGeneration(config).to(device=device, dtype=dtype)

    def batch(step: int) -> dict[str, torch.Tensor]:
        g = zc.generator(step, 7300)
        src = torch.randint(4, vocab_size, (batch_size, src_len), generator=g)
        tgt = torch.randint(4, vocab_size, (batch_size, tgt_len), generator=g)
        lengths = torch.randint(src_len // 2, src_len + 1, (batch_size,), generator=g)
        attention_mask = (torch.arange(src_len)[None, :] < lengths[:, None]).long()
        return zc.to_device({"input_ids": torch.where(attention_mask.bool(), src, config.pad_token_id),
                             "attention_mask": attention_mask, "labels": tgt}, device)

    return zc.remat.Workload(model=model, batch=batch, loss=zc.hf_loss, optimizer=zc.adamw)
