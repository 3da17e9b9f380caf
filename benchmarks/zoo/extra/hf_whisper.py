import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch
from _h import zc
def build(batch_size=4, frames=200, tgt_len=32, *, device="cpu", dtype=torch.float32):
    tf = zc.import_transformers()
    cfg = tf.WhisperConfig(vocab_size=512, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=64,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=128,
                           decoder_ffn_dim=128, max_source_positions=frames // 2, max_target_positions=64,
                           use_cache=False, pad_token_id=0, decoder_start_token_id=1)
    model = tf.WhisperForConditionalGeneration(cfg).to(device=device, dtype=dtype)
    def batch(step):
        g = zc.generator(step, 5300)
        x = torch.randn(batch_size, 16, frames, generator=g)
        labels = torch.randint(2, 512, (batch_size, tgt_len), generator=g)
        return {"input_features": x.to(device=device, dtype=dtype), "labels": labels.to(device)}
    return zc.remat.Workload(model=model, batch=batch, loss=zc.hf_loss, optimizer=zc.adamw)
