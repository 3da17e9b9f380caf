import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch, _h
def build(batch_size=8, seq_len=128, *, device="cpu", dtype=torch.float32):
    return _h.causal("OPTForCausalLM", "OPTConfig", batch_size, seq_len, 1024, device, dtype, hidden_size=128,
                     ffn_dim=512, num_hidden_layers=4, num_attention_heads=4, dropout=0.1, attention_dropout=0.1,
                     word_embed_proj_dim=128, max_position_embeddings=256)
