import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _h import zc
def build(batch_size=8, seq_len=128, *, device="cpu", dtype=torch.float32):
    tf = zc.import_transformers()
    cfg = tf.DebertaV2Config(vocab_size=1024, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                             intermediate_size=512, max_position_embeddings=256, num_labels=3)
    model = tf.DebertaV2ForSequenceClassification(cfg).to(device=device, dtype=dtype)
    def batch(step):
        g = zc.generator(step, 5200)
        ids = torch.randint(0, 1024, (batch_size, seq_len), generator=g)
        return zc.to_device({"input_ids": ids, "labels": torch.randint(0, 3, (batch_size,), generator=g)}, device)
    return zc.remat.Workload(model=model, batch=batch, loss=zc.hf_loss, optimizer=zc.adamw)
