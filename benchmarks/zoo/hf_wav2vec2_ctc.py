"""Hugging Face `Wav2Vec2ForCTC` from a small `Wav2Vec2Config` with its default layerdrop (0.1):
each training step skips each encoder layer with probability ``layerdrop`` (``torch.rand``), so
steps differ in which layers run (dynamic control flow, NOTE [step sample]). CTC loss on random
label sequences, AdamW.

In the zoo (``make zoo``), and ``benchmarks/step_sample.py`` runs it single step against the step
sample.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # remat loads this file stand-alone; its helpers live beside it
    sys.path.insert(0, _HERE)
import _zoo_common as zc  # noqa: E402


def build(batch_size: int = 4, samples: int = 4000, n_layer: int = 4, hidden_size: int = 64, layerdrop: float = 0.1,
          *, device="cpu", dtype=torch.float32):
    transformers = zc.import_transformers()
    config = transformers.Wav2Vec2Config(
        vocab_size=32, hidden_size=hidden_size, num_hidden_layers=n_layer, num_attention_heads=4,
        intermediate_size=4 * hidden_size, conv_dim=(32, 32, 32), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, layerdrop=layerdrop, mask_time_prob=0.0,
        ctc_loss_reduction="mean", pad_token_id=0)
    model = transformers.Wav2Vec2ForCTC(config).to(device=device, dtype=dtype)

    def batch(step: int) -> dict[str, torch.Tensor]:
        g = zc.generator(step, 5100)
        audio = torch.randn(batch_size, samples, generator=g)                   # (B, samples) raw waveform
        labels = torch.randint(1, 32, (batch_size, samples // 400), generator=g)  # (B, L), L << frames
        return zc.to_device({"input_values": audio, "labels": labels}, device)

    return zc.remat.Workload(model=model, batch=batch, loss=zc.hf_loss, optimizer=zc.adamw)
