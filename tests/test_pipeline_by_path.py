"""The pipeline engine on models without pipeline_embed/pipeline_head, split by module path (NOTE [pipeline by
module path] in remat/distributed/pipeline/chain.py): an unmodified HF Llama and an nn.TransformerEncoder
classifier. In-process checks against the unsplit model (ground truth), the refusals, and the launch."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from remat.cli.main import main
from remat.distributed.worker import FAULT_ENV
from remat.errors import WorkloadError
from remat.distributed.pipeline.chain import PathChain
from remat.distributed.pipeline.engine import build_stage_module, stage_layout
from remat.workload import load_workload

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "pipeline_by_path.py"
MODELS = ["llama", "encoder_classifier"]


def _backward_chain(wl, whole, stages, ids, targets, unpack):
    outs, ins = [], []
    x = ids
    for k, st in enumerate(stages):
        inp = x if k == 0 else x.detach().requires_grad_()
        ins.append(inp)
        x = st(inp)
        outs.append(x)

    class Fixed:
        def __call__(self, *a, **kw):
            return unpack(outs[-1])   # the last stage hands torch tensors; the loss gets the model's output object
    loss = wl.loss(Fixed(), (ids, targets))
    loss.backward()
    for k in range(len(stages) - 2, -1, -1):
        outs[k].backward(ins[k + 1].grad)
    want = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
    got: dict[str, torch.Tensor] = {}
    for st in stages:
        for n, p in st.named_parameters():
            if p.grad is not None:
                got[n.removeprefix("model.").replace("owned.", "").replace("__", ".")] = p.grad
    same_out = bool(torch.equal(_out(unpack(outs[-1])), _out(whole(ids))))
    return want, got, same_out


def _out(o):
    return o.logits if hasattr(o, "logits") else o


@pytest.mark.parametrize("name, points", [("llama", ["model.layers.1", "model.layers.2"]),
                                          ("encoder_classifier", ["encoder.layers.2"])])
def test_stages_chained_by_hand_are_the_unsplit_model_bitwise(name, points):
    """Ground truth: the unsplit model's output and every parameter's gradient, on the same batch."""
    want, got, same_out = _backward_chain_for(f"{FIXTURE}:{name}", points)
    assert same_out
    assert set(got) == set(want), set(want) ^ set(got)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]


def _backward_chain_for(spec: str, points: list[str]):
    torch.manual_seed(0)
    wl = load_workload(spec, {"n_layer": 3}).workload
    ids, targets = wl.batch(0)
    layout = stage_layout(wl.model, points, len(points) + 1, ids)
    assert isinstance(layout.chain, PathChain)
    stages = [build_stage_module(copy.deepcopy(wl.model), layout, k) for k in range(layout.stages)]
    wl.loss(wl.model, (ids, targets)).backward()
    return _backward_chain(wl, wl.model, stages, ids, targets, layout.chain.unpack)


class Masked(nn.Module):
    """Blocks take a padding mask computed from the batch: replayed as a constant it would be wrong."""

    def __init__(self, learned_bias: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 8)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
                                    for _ in range(2))
        self.bias = nn.Parameter(torch.zeros(4, 4)) if learned_bias else None

    def forward(self, ids):
        h = self.embed(ids)
        pad = ids == 0                                        # (B, T): depends on the batch
        for layer in self.layers:
            if self.bias is not None:
                h = layer(h, src_mask=self.bias * 1.0)        # computed from a parameter: carries a gradient
            else:
                h = layer(h, src_key_padding_mask=pad)
        return h.sum()


def test_a_batch_dependent_block_argument_is_refused_and_a_constant_one_is_not():
    model = Masked()
    sample = torch.tensor([[1, 2, 3, 4]])
    layout = stage_layout(model, ["layers.1"], 2, sample)
    assert torch.equal(layout.chain.embed(model, torch.tensor([[5, 6, 7, 1]])), model.embed(torch.tensor([[5, 6, 7, 1]])))
    with pytest.raises(WorkloadError, match="depend on the batch"):
        layout.chain.embed(model, torch.tensor([[5, 6, 0, 0]]))   # padding: another mask than the sample's
    with pytest.raises(WorkloadError, match="carries a gradient"):
        stage_layout(Masked(learned_bias=True), ["layers.1"], 2, sample)


@pytest.fixture
def rank_env(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    return monkeypatch


@pytest.mark.parametrize("name", MODELS)
def test_frontier_engine_pipeline_world_size_2_on_a_model_as_people_bring_it(rank_env, tmp_path, name):
    """`remat frontier --engine pipeline --world-size 2`: no plan, the uniform plan and remat's per-stage plans,
    gradients bitwise equal to the unplanned pipeline's (and the negative control rejected)."""
    code = main(["frontier", "--workload", f"{FIXTURE}:{name}", "--shape", "batch_size=8,seq_len=32",
                 "--engine", "pipeline", "--world-size", "2", "--microbatches", "2", "--budget", "95%",
                 "--out", str(tmp_path), "--dist-steps", "1", "--dist-timeout", "30", "--dist-wall-timeout", "300"])
    d = json.loads((tmp_path / "pipeline.json").read_text())
    for side in ("uniform", "remat"):
        eq = d["pipeline"]["equivalence"][side]
        assert eq["bitwise_equal"] and eq["ok"] and not eq["mismatched"] and eq["params_compared"] > 0, eq
    assert d["pipeline"]["negative_control_rejected"] is True
    assert any(r["stage"]["boundaries"] for r in d["per_rank"]["uniform"])
    assert code == 0
