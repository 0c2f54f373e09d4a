"""``bench/dflash_launches.py``: what its counter counts as a launch (Triton launches once, with the interpreter's
own operations inside them left out; torch operations, in place ones too; no views or no-op conversions), and
the device-loop step's three parts counted on a tiny random target and draft."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated


def test_the_counter_counts_launches_not_views(bench_script):
    dflash_launches = bench_script("dflash_launches")
    from engine.kernels.rms_norm import rms_norm_triton

    x, w = torch.randn(3, 16), torch.rand(16)
    with dflash_launches.Launches() as c:
        y = x.view(16, 3).t().t().reshape(3, 16).to(torch.float32)  # no launch
        y = y + 1  # one
        y.index_copy_(0, torch.tensor([1]), x[:1])  # one (in place); the index tensor's making is not an op here
        rms_norm_triton(y, w, 1e-6)  # one Triton launch, whatever the interpreter does inside
    assert dict(c.triton) == {"_rms_norm_kernel": 1}
    assert c.torch["add"] == 1 and c.torch["index_copy_"] == 1
    assert not {"view", "t", "reshape", "to"} & set(c.torch)
    assert c.total == sum(c.torch.values()) + 1


def test_the_step_parts_are_counted(bench_script, tmp_path):
    dflash_launches = bench_script("dflash_launches")
    from engine.dflash.draft import DFlashDraft
    from engine.dflash.train import new_draft_config
    from engine.gguf.make_model import make_model
    from engine.gguf.reader import GGUFFile
    from engine.model.qwen35moe import Qwen35MoE

    with GGUFFile(make_model(tmp_path / "t.gguf", "tiny", seed=1)) as f:
        model = Qwen35MoE.from_gguf(f, device="cpu")
    draft = DFlashDraft(new_draft_config(model.cfg, n_layers=1, block_size=8, layer_ids=(1, 3)))
    draft.init_random(torch.Generator().manual_seed(0)).requires_grad_(False)
    counts = dflash_launches.count_parts(model, draft, 4, prompt=8)
    assert set(counts) == {"draft", "verify", "advance"}
    assert all(c.total > 0 for c in counts.values())
    assert counts["verify"].total > counts["draft"].total  # the target's layers against the draft's one
    plain = dflash_launches.count_plain(model, prompt=8)
    # the same static step over one token: the target's launches without the verify block's argmax and acceptance
    assert 0 < plain.total < counts["verify"].total
    assert set(plain.triton) <= set(counts["verify"].triton)
