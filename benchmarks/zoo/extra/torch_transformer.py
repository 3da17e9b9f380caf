import torch
from torch import nn
import remat
class Seq2Seq(nn.Module):
    def __init__(self, vocab=512, d=64):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.tf = nn.Transformer(d_model=d, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                                 dim_feedforward=128, dropout=0.1, batch_first=True)
        self.out = nn.Linear(d, vocab)
    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        return self.out(self.tf(self.emb(src), self.emb(tgt), tgt_mask=mask, tgt_is_causal=True))
def build(batch_size=8, seq_len=64, *, device="cpu", dtype=torch.float32):
    model = Seq2Seq().to(device=device, dtype=dtype)
    def batch(step):
        g = torch.Generator().manual_seed(5800 + step)
        return (torch.randint(0, 512, (batch_size, seq_len), generator=g).to(device),
                torch.randint(0, 512, (batch_size, seq_len), generator=g).to(device))
    def loss(m, b):
        src, tgt = b
        logits = m(src, tgt[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt[:, 1:].reshape(-1))
    return remat.Workload(model=model, batch=batch, loss=loss)
