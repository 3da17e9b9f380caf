"""Helpers for the extra zoo models (ones the zoo was not written against): a causal LM from a config."""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the zoo folder: _zoo_common, _torchvision_cpu
import torch
import _zoo_common as zc
from _torchvision_cpu import import_torchvision  # noqa: F401 - re-exported for the tv_* factories

def causal(model_cls_name, config_name, batch_size, seq_len, vocab, device, dtype, **cfg):
    tf = zc.import_transformers()
    config = getattr(tf, config_name)(vocab_size=vocab, use_cache=False, **cfg)
    model = getattr(tf, model_cls_name)(config).to(device=device, dtype=dtype)
    def batch(step):
        g = zc.generator(step, 5100)
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        return zc.to_device({"input_ids": ids, "labels": ids.clone()}, device)
    return zc.remat.Workload(model=model, batch=batch, loss=zc.hf_loss, optimizer=zc.adamw)
