"""Draft training: the block loss, corpus handling, a short run with its report, resume, the CLI."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import typer
from typer.testing import CliRunner

from engine.dflash.cli import parse_duration, register
from engine.dflash.draft import DFlashDraft, DraftCache, block_hidden
from engine.dflash.gguf_io import load_draft
from engine.dflash.train import (TrainOptions, block_loss, default_gamma, new_draft_config, read_corpus,
                                 split_documents, train_draft)
from engine.errors import ConfigError
from engine.gguf.make_model import preset_config
from engine.tokenizer import Tokenizer
from engine.gguf.reader import GGUFFile

SEPARATOR = "<|endoftext|>"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    sources = sorted(Path(json.__file__).parent.glob("*.py"))
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    docs = [p.read_text(encoding="utf-8")[:3000] for p in sources] * 3
    path.write_text(SEPARATOR.join(f"{i}: {d}" for i, d in enumerate(docs)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(target_path):
    with GGUFFile(target_path) as f:
        return Tokenizer.from_metadata(f.metadata, source=str(target_path))


def test_gamma_and_shape_defaults():
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0 and default_gamma(4) == 2.0
    cfg = new_draft_config(preset_config("qwen3.6-35b-a3b", vocab=248320))
    assert (cfg.hidden, cfg.head_dim, cfg.n_head, cfg.n_head_kv, cfg.ffn) == (2048, 128, 16, 4, 6144)
    assert cfg.target_layer_ids == (1, 10, 19, 28, 37) and cfg.mask_token_id == 248070 and cfg.block_size == 16
    with pytest.raises(ConfigError, match="draft shape: draft block_size must be at least 2"):
        new_draft_config(preset_config("tiny", vocab=100), block_size=1)


def test_block_loss_is_the_weighted_cross_entropy_of_lone_blocks(target):
    cfg = new_draft_config(target.cfg, n_layers=1, block_size=4, layer_ids=(0, 3))
    draft = DFlashDraft(cfg).init_random(torch.Generator().manual_seed(0), std=0.1)
    gen = torch.Generator().manual_seed(1)
    L = 10
    ids = torch.randint(0, 500, (L,), generator=gen)
    labels = torch.randint(0, 500, (L,), generator=gen)
    features = torch.randn(L, 2 * cfg.hidden, generator=gen)
    anchors = torch.tensor([2, 7])  # the block at 7 runs past the end: its last slot carries no loss
    gamma = 2.0
    loss, accepted = block_loss(draft, target.weights.embed, target.weights.output, features, ids, labels, anchors,
                                gamma)
    num = den = 0.0
    for a in anchors.tolist():
        cache = DraftCache.empty(draft, L)
        if a:
            cache.extend(draft, features[:a], torch.arange(a))
        block = torch.tensor([int(ids[a])] + [cfg.mask_token_id] * 3)
        logits = F.linear(block_hidden(draft, cache, F.embedding(block, target.weights.embed), a)[1:],
                          target.weights.output)
        for k in range(1, 4):
            if a + k < L:
                w = torch.exp(torch.tensor(-(k - 1) / gamma))
                num = num + w * F.cross_entropy(logits[k - 1:k], labels[a + k:a + k + 1])
                den = den + w
    torch.testing.assert_close(loss, (num / den).reshape(()), atol=1e-5, rtol=1e-5)
    assert accepted.shape == (2,) and ((accepted >= 1) & (accepted <= 4)).all()


def test_corpus_reading_and_split(tmp_path, corpus):
    docs = read_corpus(corpus)
    assert len(docs) > 10 and not any(SEPARATOR in d for d in docs)
    train, held = split_documents(docs, 0.1)
    assert held and train and len(train) + len(held) == len(docs)
    assert split_documents(docs, 0.1) == (train, held)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.md").write_text("one")
    (tmp_path / "a" / "y.bin").write_bytes(b"\x00")
    assert read_corpus(tmp_path / "a") == ["one"]
    with pytest.raises(ConfigError, match="does not exist"):
        read_corpus(tmp_path / "missing")
    (tmp_path / "b").mkdir()
    with pytest.raises(ConfigError, match="holds no text file"):
        read_corpus(tmp_path / "b")
    with pytest.raises(ConfigError, match="at least 2 are needed"):
        split_documents(["only"], 0.1)


def _opts(**overrides):
    kw = dict(steps=6, seq_len=48, anchors=8, lr=3e-3, warmup_steps=2, ckpt_every=2, eval_prompts=2,
              eval_prompt_len=16, eval_new_tokens=12, weights="f32", held_out_fraction=0.2)
    return TrainOptions(**(kw | overrides))


def _cfg(target):
    return new_draft_config(target.cfg, n_layers=1, block_size=4, layer_ids=(1, 3))


def test_training_writes_draft_and_report_and_resumes_exactly(target, tokenizer, corpus, tmp_path):
    out_a = tmp_path / "a" / "draft.gguf"
    report = train_draft(target, tokenizer, _cfg(target), corpus, out_a, _opts(), target_name="target.gguf")
    assert report.steps == 6 and report.final_loss == report.final_loss  # finite
    data = json.loads(out_a.with_suffix(".acceptance.json").read_text())
    assert data["held_out"]["prompts"] == 2 and data["held_out"]["spec_len"] == 4
    assert 1.0 <= data["held_out"]["acceptance_length"] <= 4.0 and data["steps_this_run"] == 6
    assert out_a.with_name("draft.gguf.ckpt").exists()

    def interrupt(step, total, metrics):
        assert metrics["loss"] > 0
        if step == 3:
            raise KeyboardInterrupt

    out_b = tmp_path / "b" / "draft.gguf"
    with pytest.raises(KeyboardInterrupt):
        train_draft(target, tokenizer, _cfg(target), corpus, out_b, _opts(), target_name="target.gguf",
                    progress=interrupt)
    assert not out_b.exists()
    seen = []
    report_b = train_draft(target, tokenizer, _cfg(target), corpus, out_b, _opts(), target_name="target.gguf",
                           progress=lambda step, total, m: seen.append(step))
    assert seen == [3, 4, 5, 6] and report_b.steps == 6  # resumed from the checkpoint of step 2
    a, b = dict(load_draft(out_a).named_parameters()), dict(load_draft(out_b).named_parameters())
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-5, msg=name)

    with pytest.raises(ConfigError, match="belongs to another run .* --restart"):
        train_draft(target, tokenizer, _cfg(target), corpus, out_b, _opts(lr=1e-3), target_name="target.gguf")


def test_time_budget_ends_training_early(target, tokenizer, corpus, tmp_path):
    report = train_draft(target, tokenizer, _cfg(target), corpus, tmp_path / "d.gguf",
                         _opts(steps=100_000, time_budget_s=1.0), target_name="target.gguf")
    assert 0 < report.steps < 100_000
    assert (tmp_path / "d.gguf").exists()


def test_cli_trains_a_draft(target_path, corpus, tmp_path):
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)  # a second command keeps train-draft a named subcommand
    out = tmp_path / "cli.gguf"
    result = CliRunner().invoke(app, [
        "train-draft", "--target", str(target_path), "--corpus", str(corpus), "--out", str(out), "--steps", "2",
        "--seq-len", "32", "--anchors", "4", "--layers", "1", "--features", "2", "--block-size", "4",
        "--eval-prompts", "1", "--eval-new-tokens", "4", "--weights", "f32", "--device", "cpu", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert out.exists() and out.with_suffix(".acceptance.json").exists()
    result = CliRunner().invoke(app, ["train-draft", "--target", str(target_path), "--corpus", str(corpus),
                                      "--out", str(out), "--time-budget", "soon"])
    assert isinstance(result.exception, ConfigError) and "time budget 'soon'" in str(result.exception)


def test_durations_parse():
    assert parse_duration("90m") == 5400 and parse_duration("2h") == 7200 and parse_duration("30") == 1800
    assert parse_duration("3600s") == 3600
    for bad in ("0", "-1m", "1d", ""):
        with pytest.raises(ConfigError):
            parse_duration(bad)
