"""Hugging Face `GPT2LMHeadModel` from a small `GPT2Config` (random init, no download), AdamW.

attn_implementation="eager": GPT-2's own attention code (the (B, h, T, T) score matrix is
materialised, and its q/k/v come from slicing one c_attn projection: the case where torch's
selective checkpointing fails with "encountered during backward but not found in storage").
Dropout 0.1 everywhere (HF's default), so every block draws random numbers.

Peak: 0.96 M parameters (4 x 3.7 MiB with gradients and Adam state); at batch_size=8,
seq_len=128 the per-layer attention maps (8 x 4 x 128 x 128 floats = 2 MiB each, kept as
scores, softmax, dropout mask and output) and the 4x MLP activations dominate (about 150 MiB
saved for backward).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # remat loads this file stand-alone; its helpers live beside it
    sys.path.insert(0, _HERE)
import _zoo_common as zc  # noqa: E402


def build(batch_size: int = 8, seq_len: int = 128, n_layer: int = 4, n_embd: int = 128, vocab_size: int = 1024,
          *, device="cpu", dtype=torch.float32):
    transformers = zc.import_transformers()
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=4, vocab_size=vocab_size,
                                     n_positions=max(seq_len, 64), bos_token_id=vocab_size - 1,
                                     eos_token_id=vocab_size - 1, use_cache=False, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config).to(device=device, dtype=dtype)

    def batch(step: int) -> dict[str, torch.Tensor]:
        g = zc.generator(step, 2100)
        ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
        return zc.to_device({"input_ids": ids, "labels": ids.clone()}, device)  # the model shifts labels itself

    return zc.remat.Workload(model=model, batch=batch, loss=zc.hf_loss, optimizer=zc.adamw)
