"""``bench/dflash_host.py``: the device loop's host work per step with its launches stood in for, on a tiny
random target and draft: the loop runs exactly the steps asked for at any lag, and the figure is a time."""

import pytest
import torch

from engine.dflash.draft import DFlashDraft
from engine.dflash.train import new_draft_config
from engine.gguf.make_model import make_model
from engine.gguf.reader import GGUFFile
from engine.model.qwen35moe import Qwen35MoE


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_each_step_commits_two_tokens_and_is_timed(bench_script, tmp_path, lag):
    dflash_host = bench_script("dflash_host")
    with GGUFFile(make_model(tmp_path / "t.gguf", "tiny", seed=1)) as f:
        model = Qwen35MoE.from_gguf(f, device="cpu")
    cfg = new_draft_config(model.cfg, n_layers=1, block_size=8, layer_ids=(1, 3))
    draft = DFlashDraft(cfg).init_random(torch.Generator().manual_seed(0)).requires_grad_(False)
    with torch.inference_mode():
        row = dflash_host.host_us(model, draft, spec_len=4, steps=25, lag=lag, repeats=2)
    assert row["steps"] == 25 and len(row["runs_us"]) == 2
    assert 0 < row["us"] < 1e6 and min(row["runs_us"]) <= row["us"] <= max(row["runs_us"])
