"""Draft training: the block loss, corpus handling, a short run with its report, resume, the CLI."""

import json
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from engine.dflash.cli import parse_duration, parse_layer_ids, register
from engine.dflash.gguf_io import load_draft
from engine.dflash import train as train_module
from engine.dflash.block_loss import default_gamma
from engine.dflash.distill import cache_path
from engine.dflash.train import (TrainOptions, new_draft_config, read_corpus, split_documents, train_draft,
                                 training_and_held_out)
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
    assert new_draft_config(preset_config("qwen3.6-35b-a3b", vocab=248320), n_head_kv=16).n_head_kv == 16
    with pytest.raises(ConfigError, match="draft shape: draft n_head 16 is not a multiple of n_head_kv 3"):
        new_draft_config(preset_config("qwen3.6-35b-a3b", vocab=248320), n_head_kv=3)


def test_layer_ids_are_parsed_and_checked_against_the_target_depth():
    assert parse_layer_ids("1,4,7", 8) == (1, 4, 7)
    assert parse_layer_ids("7, 0", 8) == (7, 0)
    for bad, why in (("1,8", "0..7"), ("1,1", "distinct"), ("-1,2", "0..7"), ("1;4", "comma-separated integers")):
        with pytest.raises(ConfigError, match=why):
            parse_layer_ids(bad, 8)


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


def test_a_held_out_file_leaves_the_whole_corpus_to_training_less_the_documents_they_share(tmp_path, corpus):
    docs = read_corpus(corpus)
    held_path = tmp_path / "held.txt"
    novel = ["def novel():\n    return 1\n", "class Fresh:\n    pass\n"]
    held_path.write_text(SEPARATOR.join(novel))
    assert training_and_held_out(corpus, held_path, 0.1) == (docs, novel, 0)
    assert training_and_held_out(corpus, None, 0.1) == (*split_documents(docs, 0.1), 0)
    shared = tmp_path / "shared.txt"
    shared.write_text(SEPARATOR.join([docs[3], novel[1], docs[5]]))
    assert training_and_held_out(corpus, shared, 0.1) == (docs, [novel[1]], 2)
    leaked = tmp_path / "leaked.txt"
    leaked.write_text(SEPARATOR.join([docs[3], docs[5]]))
    with pytest.raises(ConfigError, match=r"leaked.txt: all 2 of its documents are also in the corpus"):
        training_and_held_out(corpus, leaked, 0.1)
    with pytest.raises(ConfigError, match="does not exist"):
        training_and_held_out(corpus, tmp_path / "missing.txt", 0.1)


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
    assert 1.0 <= data["teacher_forced_median_row"] <= 4.0 and 1.0 <= data["teacher_forced_acceptance"] <= 4.0
    assert out_a.with_name("draft.gguf.ckpt").exists()

    def interrupt(step, total, metrics):
        assert metrics["loss"] > 0
        if step == 3:
            raise KeyboardInterrupt

    out_b = tmp_path / "b" / "draft.gguf"
    executor = target.executor
    assert train_module.pass_executor(target) is executor  # the CPU keeps the reference executor
    with pytest.raises(KeyboardInterrupt):
        train_draft(target, tokenizer, _cfg(target), corpus, out_b, _opts(), target_name="target.gguf",
                    progress=interrupt)
    assert target.executor is executor  # given back, interrupted or not
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
    assert data["held_out"]["source"] == "0.2 of the corpus's documents by content hash"
    assert data["held_out"]["left_out_as_in_corpus"] == 0 and data["held_out"]["documents"] > 0


def test_held_out_text_of_its_own_feeds_the_report_and_changes_the_run(target, tokenizer, corpus, tmp_path):
    # code that is not in the corpus
    sources = [p for p in sorted(Path(typer.__file__).parent.glob("*.py")) if p.stat().st_size > 500]
    held_path = tmp_path / "held.txt"
    held_path.write_text(SEPARATOR.join([read_corpus(corpus)[0]] +
                                        [p.read_text(encoding="utf-8")[:2000] for p in sources[:4]]))
    out = tmp_path / "h" / "draft.gguf"
    report = train_draft(target, tokenizer, _cfg(target), corpus, out, _opts(steps=2), target_name="target.gguf",
                         held_out=held_path)
    data = json.loads(out.with_suffix(".acceptance.json").read_text())
    assert data["held_out"]["source"] == str(held_path) == report.held_out["source"]
    assert data["held_out"]["documents"] == 4 and data["held_out"]["left_out_as_in_corpus"] == 1
    assert data["held_out"]["prompts"] == 2 and 1.0 <= data["held_out"]["acceptance_length"] <= 4.0
    # the run trained on the whole corpus: its checkpoint is not that of a split run
    with pytest.raises(ConfigError, match="belongs to another run"):
        train_draft(target, tokenizer, _cfg(target), corpus, out, _opts(steps=2), target_name="target.gguf")


def test_training_from_a_draft_starts_at_its_weights_and_refuses_another_shape(target, tokenizer, corpus, tmp_path):
    first = tmp_path / "first.gguf"
    train_draft(target, tokenizer, _cfg(target), corpus, first, _opts(steps=3), target_name="target.gguf")
    again = tmp_path / "again.gguf"  # one step at a learning rate that leaves the weights where they start
    train_draft(target, tokenizer, _cfg(target), corpus, again, _opts(steps=1, lr=1e-12, warmup_steps=1),
                target_name="target.gguf", init=first)
    a, b = dict(load_draft(first).named_parameters()), dict(load_draft(again).named_parameters())
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-7, rtol=0, msg=name)
    fresh = tmp_path / "fresh.gguf"
    train_draft(target, tokenizer, _cfg(target), corpus, fresh, _opts(steps=1, lr=1e-12, warmup_steps=1),
                target_name="target.gguf")
    assert not torch.equal(dict(load_draft(fresh).named_parameters())["fc"], a["fc"])
    # a checkpoint of a run from random weights is not resumed from a draft
    with pytest.raises(ConfigError, match="belongs to another run"):
        train_draft(target, tokenizer, _cfg(target), corpus, fresh, _opts(steps=1, lr=1e-12, warmup_steps=1),
                    target_name="target.gguf", init=first)
    other = new_draft_config(target.cfg, n_layers=1, block_size=4, layer_ids=(1, 3), n_head_kv=2)
    with pytest.raises(ConfigError, match=r"first.gguf is of another shape: n_head_kv 1 \(the draft being trained: 2"):
        train_draft(target, tokenizer, other, corpus, tmp_path / "other.gguf", _opts(steps=1),
                    target_name="target.gguf", init=first)


def _distill_opts(**overrides):
    return _opts(**({"distill": 6, "distill_prompt": 12, "distill_new": 20, "distill_batch": 4, "batch": 2}
                    | overrides))


def test_distilled_training_anchors_in_the_generated_part_and_reports_agreement(target, target_path, tokenizer,
                                                                                 corpus, tmp_path, monkeypatch):
    anchors = []
    real = train_module.block_loss
    monkeypatch.setattr(train_module, "block_loss", lambda *a: anchors.append(a[6].clone()) or real(*a))
    metrics = []
    out = tmp_path / "d.gguf"
    report = train_draft(target, tokenizer, _cfg(target), corpus, out, _distill_opts(), target_name="target.gguf",
                         target_path=target_path, progress=lambda step, total, m: metrics.append(m))
    drawn = torch.cat([a.flatten() for a in anchors])
    assert drawn.min() >= 12 and drawn.max() <= 30  # the generated part of rows of 12 + 20 tokens
    assert len(anchors) == 6 and anchors[0].shape == (2, 8)
    assert report.distill["agreement"] == 1.0 and report.distill["target_passes"] == 6
    assert metrics[-1]["agree"] == 1.0
    # each step's batch of 2 draws sequences it had not seen yet in the first epoch (6 sequences)
    assert [m["passes"] for m in metrics] == [2, 4, 6, 6, 6, 6]
    data = json.loads(out.with_suffix(".acceptance.json").read_text())
    assert data["distill"]["sequences"] == 6 and data["distill"]["new_tokens"] == 20
    assert cache_path(out).is_file()

    with pytest.raises(ConfigError, match="belongs to another run"):
        train_draft(target, tokenizer, _cfg(target), corpus, out, _distill_opts(distill_new=16),
                    target_name="target.gguf", target_path=target_path)
    with pytest.raises(ConfigError, match="needs the target's GGUF file"):
        train_draft(target, tokenizer, _cfg(target), corpus, tmp_path / "e.gguf", _distill_opts(),
                    target_name="target.gguf")


def test_a_step_split_into_several_draft_forwards_trains_the_same_draft(target, tokenizer, corpus, tmp_path,
                                                                        monkeypatch):
    opts = _opts(steps=3, batch=3)
    a = train_draft(target, tokenizer, _cfg(target), corpus, tmp_path / "a.gguf", opts, target_name="t.gguf")
    monkeypatch.setattr(train_module, "rows_per_forward", lambda *args, **kwargs: 1)
    b = train_draft(target, tokenizer, _cfg(target), corpus, tmp_path / "b.gguf", opts, target_name="t.gguf")
    assert b.final_loss == pytest.approx(a.final_loss, rel=1e-5)
    pa, pb = (dict(load_draft(tmp_path / f"{x}.gguf").named_parameters()) for x in "ab")
    for name in pa:  # Adam turns float32 rounding of near-zero gradients into ~1e-6 differences
        torch.testing.assert_close(pb[name], pa[name], atol=1e-5, rtol=1e-5, msg=name)


def test_distill_options_are_validated():
    with pytest.raises(ValueError, match="distill must be 0 .off. or a number of sequences, got -1"):
        _opts(distill=-1)
    with pytest.raises(ValueError, match="new_tokens must be at least 2"):
        _opts(distill=4, distill_new=1)
    assert _opts().distill_options is None and _distill_opts().distill_options.seq_len == 32


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

    def corpus_rows(path, *choice):  # a short run on corpus windows, the draft's feature layers by ``choice``
        return CliRunner().invoke(app, [
            "train-draft", "--target", str(target_path), "--corpus", str(corpus), "--out", str(path), "--steps", "2",
            "--seq-len", "32", "--anchors", "4", "--layers", "1", *choice, "--block-size", "4",
            "--eval-prompts", "1", "--eval-new-tokens", "4", "--weights", "f32", "--device", "cpu", "--no-progress"])

    result = corpus_rows(out, "--features", "2")
    assert result.exit_code == 0, result.output
    assert out.exists() and out.with_suffix(".acceptance.json").exists()
    assert "prompts of 0.05 of the corpus's documents by content hash" in " ".join(result.output.split())
    leaked = tmp_path / "leaked.txt"
    leaked.write_text(read_corpus(corpus)[0])
    result = corpus_rows(tmp_path / "leak.gguf", "--held-out", str(leaked))
    assert isinstance(result.exception, ConfigError) and "all 1 of its documents are also in" in str(result.exception)
    picked = tmp_path / "ids.gguf"
    result = corpus_rows(picked, "--layer-ids", "1,0", "--kv-heads", "2")
    assert result.exit_code == 0, result.output
    assert load_draft(picked).cfg.target_layer_ids == (1, 0) and load_draft(picked).cfg.n_head_kv == 2
    assert "4 heads (2 key/value) reading target layers [1, 0]" in " ".join(result.output.split())
    result = corpus_rows(tmp_path / "init.gguf", "--layer-ids", "1,0", "--kv-heads", "2", "--init", str(picked))
    assert result.exit_code == 0, result.output
    result = corpus_rows(tmp_path / "init.gguf", "--layer-ids", "1,0", "--init", str(picked), "--restart")
    assert isinstance(result.exception, ConfigError)
    assert "n_head_kv 2 (the draft being trained: 1)" in str(result.exception)
    result = CliRunner().invoke(app, [
        "train-draft", "--target", str(target_path), "--corpus", str(corpus), "--out", str(out), "--steps", "2",
        "--distill", "3", "--distill-prompt", "8", "--distill-new", "8", "--distill-batch", "2", "--anchors", "4",
        "--batch", "8",
        "--layers", "1", "--features", "2", "--block-size", "4", "--eval-prompts", "1", "--eval-new-tokens", "4",
        "--eval-prompt-tokens", "24", "--weights", "f32", "--device", "cpu", "--restart"])
    assert result.exit_code == 0, result.output
    assert "distilled 3 sequences of 8 + 8 tokens" in result.output and "agrees" in result.output
    said = " ".join(result.output.split())
    assert "2 steps of 8 rows over 3 distilled sequences is 5 epochs" in said
    assert "distilled rows of 16 tokens are shorter than the evaluation's 24 + 4" in said
    report = json.loads(out.with_suffix(".acceptance.json").read_text())
    assert report["distill"]["prompt_len"] == 8 and report["held_out"]["prompt_tokens"] == 24
    result = CliRunner().invoke(app, ["train-draft", "--target", str(target_path), "--corpus", str(corpus),
                                      "--out", str(out), "--time-budget", "soon"])
    assert isinstance(result.exception, ConfigError) and "time budget 'soon'" in str(result.exception)


def test_durations_parse():
    assert parse_duration("90m") == 5400 and parse_duration("2h") == 7200 and parse_duration("30") == 1800
    assert parse_duration("3600s") == 3600
    for bad in ("0", "-1m", "1d", ""):
        with pytest.raises(ConfigError):
            parse_duration(bad)
