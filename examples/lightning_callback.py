"""Lightning ``Trainer`` with ``remat.integrations.lightning.RematCallback``.

    pip install -e '.[integrations]'
    python examples/lightning_callback.py
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch.nn import functional as F

from remat.integrations.lightning import RematCallback

from auto_plain_loop import SIZES, TinyLM   # the same small model as the plain-loop example


def make_module(cfg: dict, lr: float = 1e-3):
    import lightning as L

    class LitLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = TinyLM(cfg["vocab"], cfg["d"], cfg["layers"])
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())
            self.losses.append(loss.item())
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=lr)

    return LitLM()


@dataclasses.dataclass
class Result:
    losses: list[float]
    report: object | None


def main(size: str = "tiny", steps: int = 3, budget: str = "60%", plan: bool = True, seed: int = 0,
         cache_dir: str | None = None, **auto_kwargs) -> Result:
    import lightning as L
    cfg = SIZES[size]
    torch.manual_seed(seed)
    module = make_module(cfg)
    g = torch.Generator().manual_seed(seed)
    data = [(t[:, :-1], t[:, 1:]) for t in
            (torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g) for _ in range(steps))]
    callback = RematCallback(budget=budget, cache_dir=cache_dir, **auto_kwargs) if plan else None
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback] if callback else [])
    # batch_size=None: the list already holds whole batches, in order
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=None))
    return Result(losses=list(module.losses), report=callback.handle.report if callback else None)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--budget", default="60%")
    a = ap.parse_args()
    res = main(a.size, budget=a.budget)
    print(res.report.summary())
    print("losses:", res.losses)
