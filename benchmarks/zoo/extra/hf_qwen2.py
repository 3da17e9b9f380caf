import sys; from pathlib import Path; sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch, _h
def build(batch_size=8, seq_len=128, *, device="cpu", dtype=torch.float32):
    return _h.causal("Qwen2ForCausalLM", "Qwen2Config", batch_size, seq_len, 1024, device, dtype, hidden_size=128,
                     intermediate_size=344, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     tie_word_embeddings=True, max_position_embeddings=256)
