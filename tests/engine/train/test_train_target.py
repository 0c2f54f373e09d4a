"""Training, measuring and exporting members of the shipped family, on a CPU-sized shape.

The micro shape has every feature of the real ones (GDN and gated attention layers, value
heads != key heads, 16 experts top-4 plus a shared expert); its data are arithmetic
progressions, which a model learns in a few steps and a unigram model cannot.
"""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine.errors import ConfigError  # noqa: E402
from engine.train.batches import BatchSampler, Curriculum, TokenStream, eval_windows  # noqa: E402
from engine.train.evaluate import LayerRouting, evaluate, evaluate_retrieval, unigram_log_probs  # noqa: E402
from engine.train.family import DRAFTER, MICRO, SHIPPED_BUDGET_BYTES, TARGET, TARGET_BUDGET_BYTES  # noqa: E402
from engine.train.train_target import TrainConfig, TrainData, train  # noqa: E402

CPU = torch.device("cpu")
STEPS = 20


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On one thread a CPU run is bit-reproducible (reductions do not depend on the thread
    split), and these small models train faster than on contended cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def progressions(n_docs: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n_docs,), generator=g)
    strides = torch.randint(1, 9, (n_docs,), generator=g)
    return [[int((a + d * i) % vocab) for i in range(length)] for a, d in zip(starts, strides)]


@pytest.fixture(scope="module")
def tokenizer_metadata(tmp_path_factory):
    import json as json_module
    from pathlib import Path

    from engine.train.bpe import gguf_tokenizer_metadata, train_bpe
    from engine.train.corpus import write_documents

    path = tmp_path_factory.mktemp("bpe") / "text.txt"
    write_documents(path, [Path(json_module.__file__).read_text(encoding="utf-8")])
    return gguf_tokenizer_metadata(train_bpe([path], 320, seed=0))


@pytest.fixture(scope="module")
def data(tokenizer_metadata):
    vocab = len(tokenizer_metadata["tokenizer.ggml.tokens"])
    eos = tokenizer_metadata["tokenizer.ggml.eos_token_id"]
    docs = progressions(300, 150, vocab, seed=1)
    return TrainData(train=TokenStream.from_documents(docs, separator=eos),
                     heldout=TokenStream.from_documents(progressions(30, 150, vocab, seed=2), separator=eos),
                     vocab=vocab, eos_id=eos)


def micro_config(**overrides) -> TrainConfig:
    settings = dict(shape="micro", steps=STEPS, batch_tokens=512, curriculum=Curriculum(64, 128, 0.3),
                    lr=1e-2, warmup_steps=5, ckpt_every=1000)
    return TrainConfig(**(settings | overrides))


@pytest.fixture(scope="module")
def trained(data):
    return train(micro_config(), data, device=CPU)


def test_family_shapes_have_the_real_layout_and_fit_the_budget():
    vocab = 4096
    assert len(TARGET.model_config(vocab).gdn_layers) == 6 and TARGET.model_config(vocab).attention_layers == [3, 7]
    for s in (TARGET, DRAFTER, MICRO):
        assert s.gdn_v_heads != s.gdn_k_heads and s.shared_ffn > 0
    assert TARGET.n_expert >= 16 and 256 <= TARGET.hidden <= 384
    assert DRAFTER.hidden < TARGET.hidden and DRAFTER.n_layers < TARGET.n_layers
    target, drafter = TARGET.tensor_bytes(vocab), DRAFTER.tensor_bytes(vocab)
    assert target <= TARGET_BUDGET_BYTES
    # what is left must hold a DFlash draft of a few target-width layers
    assert SHIPPED_BUDGET_BYTES - target - drafter >= 10 * 10**6


@pytest.mark.parametrize("shape", [TARGET, DRAFTER, MICRO], ids=lambda s: s.name)
def test_hf_config_converts_to_the_presets_engine_config(shape):
    from engine.gguf.convert_hf import config_from_hf, hf_text_config

    got = config_from_hf(hf_text_config(shape.hf_config(4096)))
    assert got == shape.model_config(4096)


def test_batches_are_seeded_and_example_rows_hold_whole_examples():
    stream = TokenStream.from_documents(progressions(20, 50, 97, seed=3), separator=0)
    examples = TokenStream.from_documents([[5] * n for n in (10, 30, 200)], separator=1)
    sampler = BatchSampler(stream=stream, examples=examples, batch_tokens=8 * 40, example_share=0.5, seed=7)
    a, b = sampler.batch(3, 40), sampler.batch(3, 40)
    assert torch.equal(a, b) and a.shape == (8, 41)
    assert not torch.equal(a, sampler.batch(4, 40))
    example_rows = a[4:]
    # each example row starts at an example of at most 41 tokens: ten or thirty 5s, then its separator
    for row in example_rows:
        n = int((row == 5).long().cumprod(0).sum())
        assert n in (10, 30) and int(row[n]) == 1
    assert not (a[:4] == 5).any()


def test_schedule_warms_up_then_decays_to_the_floor_and_the_curriculum_ends_long():
    cfg = micro_config(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert cfg.lr_at(0, 100) == pytest.approx(1e-4) and cfg.lr_at(9, 100) == pytest.approx(1e-3)
    assert cfg.lr_at(99, 100) == pytest.approx(1e-4, rel=0.01)
    lrs = [cfg.lr_at(s, 100) for s in range(10, 100)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))
    lengths = [cfg.curriculum.seq_len(s, 100) for s in range(100)]
    assert lengths.count(128) == 30 and lengths[-1] == 128 and lengths[0] == 64


def test_training_lowers_the_loss_far_below_the_unigram_baseline(trained, data):
    model, result = trained
    losses = [v for _, v in result.loss_history]
    assert result.steps == STEPS == len(losses) and result.stopped_by == "steps"
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    rows = eval_windows(data.heldout, 128, 4096)
    held = evaluate(model, rows, unigram=unigram_log_probs(data.train.ids, data.vocab), device=CPU,
                    batch_rows=8, autocast=False)
    assert held.tokens == rows[:, 1:].numel()
    # a unigram model cannot see a progression's stride; 20 steps of the model already do
    assert held.unigram_loss > math.log(data.vocab) - 0.2
    assert held.loss < held.unigram_loss - 1.0
    assert held.unigram_entropy <= held.unigram_loss + 1e-9


def test_unigram_baseline_and_routing_counts_are_those_of_the_scored_tokens(trained, data):
    model, _ = trained
    rows = eval_windows(data.heldout, 64, 640)
    unigram = unigram_log_probs(data.train.ids, data.vocab)
    held = evaluate(model, rows, unigram=unigram, device=CPU, batch_rows=4, autocast=False)
    targets = rows[:, 1:].flatten()
    counts = torch.bincount(data.train.ids.long(), minlength=data.vocab).double() + 1
    expected = float(-(counts[targets].log() - counts.sum().log()).mean())
    assert held.unigram_loss == pytest.approx(expected, rel=1e-9)
    assert len(held.routing) == MICRO.n_layers
    for layer in held.routing:
        assert sum(layer.counts) == targets.numel() * MICRO.n_expert_used
        assert 0.25 <= layer.top_quarter_share <= 1.0


def test_top_quarter_share():
    assert LayerRouting(0, (5,) * 8).top_quarter_share == pytest.approx(0.25)
    assert LayerRouting(0, (40, 30, 10, 10, 5, 5, 0, 0)).top_quarter_share == pytest.approx(0.7)
    assert LayerRouting(0, (40, 30, 10, 10, 5, 5, 0, 0)).unused_experts == 2


def test_same_seed_same_run_and_a_resumed_run_matches_the_uninterrupted_one(data, tmp_path):
    cfg = micro_config(steps=4, ckpt_every=2)
    model_a, result_a = train(cfg, data, device=CPU)
    model_b, result_b = train(cfg, data, device=CPU)

    class Stop(Exception):
        pass

    def interrupt(info):
        if info.step == 2:
            raise Stop

    with pytest.raises(Stop):
        train(cfg, data, device=CPU, ckpt_dir=tmp_path, on_step=interrupt)
    model_c, result_c = train(cfg, data, device=CPU, ckpt_dir=tmp_path, resume=True)
    assert result_c.resumed_from == 2 and result_c.steps == 4
    for other_model, other in ((model_b, result_b), (model_c, result_c)):
        assert other.loss_history == result_a.loss_history
        for (name, p), q in zip(model_a.state_dict().items(), other_model.state_dict().values()):
            assert torch.equal(p, q), name
    other = micro_config(steps=4, ckpt_every=2, seed=1)
    with pytest.raises(ConfigError, match="'seed'"):
        train(other, data, device=CPU, ckpt_dir=tmp_path, resume=True)


def test_time_budget_plans_the_steps_and_stops_in_time(data):
    import time

    _, warm = train(micro_config(steps=3), data, device=CPU)
    budget_s = 12 * warm.train_seconds / warm.steps
    ends = []
    deadline = time.monotonic() + budget_s
    _, result = train(micro_config(steps=None, minutes=1.0, calibration_steps=3), data, device=CPU,
                      deadline=deadline, on_step=lambda info: ends.append(time.monotonic()))
    returned = time.monotonic()
    assert result.stopped_by in ("plan", "time") and result.steps == len(ends) >= 3
    assert result.planned_steps >= 3
    # no step starts after the deadline, so the run ends within one step of it
    assert ends[-2] < deadline
    longest = max(b - a for a, b in zip(ends, ends[1:]))
    assert returned - deadline <= longest + 2.0
    _, late = train(micro_config(steps=None, minutes=1.0), data, device=CPU, deadline=time.monotonic())
    assert late.steps == 0 and late.stopped_by == "time"


def test_export_reads_back_with_q8_0_matrices_f32_norms_and_runs_in_the_engine(trained, tokenizer_metadata,
                                                                                 tmp_path):
    from engine.engine import Engine
    from engine.gguf.reader import GGUFFile
    from engine.train.export import export_gguf

    model, _ = trained
    ids = list(range(5, 70, 3))
    with torch.no_grad():
        ref = model.cpu().eval()(input_ids=torch.tensor([ids])).logits[0].float()
    model.train()
    for quant, tol in (("f32", 2e-3), ("q8_0", 5e-2)):
        exported = export_gguf(model, tmp_path / f"micro-{quant}.gguf", MICRO,
                               tokenizer_metadata=tokenizer_metadata, quant=quant)
        assert exported.bytes == (tmp_path / f"micro-{quant}.gguf").stat().st_size
        with GGUFFile(exported.path) as f:
            assert f.metadata["tokenizer.ggml.tokens"] == tokenizer_metadata["tokenizer.ggml.tokens"]
            assert f.tensors["blk.0.attn_norm.weight"].qtype.name == "F32"
            assert f.tensors["blk.0.ffn_gate_exps.weight"].qtype.name == quant.upper()
        eng = Engine.from_gguf(exported.path, device="cpu")
        got = eng.logits(ids)
        rel = float((got - ref).norm() / ref.norm())
        assert rel <= tol, (quant, rel)
        assert torch.isfinite(got).all()
        out = eng.generate(ids, 8)
        vocab = len(tokenizer_metadata["tokenizer.ggml.tokens"])
        assert len(out.ids) == 8 and all(0 <= i < vocab for i in out.ids)
        assert exported.bytes_by_type[quant.upper()] > 0.8 * exported.bytes


def test_retrieval_exact_match_is_greedy_decodings_answer(trained):
    from engine.train.data import RetrievalCase

    model, _ = trained
    model.eval()
    context = [7, 14, 21, 28, 35, 42]
    ids = list(context)
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = RetrievalCase(ids=tuple(ids), answer_start=len(context))
    wrong = RetrievalCase(ids=tuple(ids[:-1] + [(ids[-1] + 1) % 320]), answer_start=len(context))
    score = evaluate_retrieval(model, [greedy, wrong], device=CPU, autocast=False, max_len=64)
    assert score.cases == 2 and score.exact_match == pytest.approx(0.5)
    assert score.by_length[0] == (512, 2, 0.5)
    assert evaluate_retrieval(model, [greedy], device=CPU, autocast=False, max_len=5) is None


def test_retrieval_case_answer_is_the_code_of_the_asked_name(tokenizer_metadata):
    import random

    from engine.tokenizer import Tokenizer
    from engine.train.corpus import SourceFile, retrieval_example
    from engine.train.data import _retrieval_case

    tok = Tokenizer.from_metadata(tokenizer_metadata, source="test")
    sources = [SourceFile("a.py", "import os\n\ndef f(x):\n    return x + 1\n" * 20)]
    for seed in range(5):
        example = retrieval_example(random.Random(seed), sources, context_chars=400, n_facts=3)
        case = _retrieval_case(tok, example.text)
        code = dict(example.facts)[example.asked]
        assert tok.decode(list(case.ids[case.answer_start:])) == f" {code}."
        assert tok.decode(list(case.ids[:case.answer_start])).endswith(f"{example.asked}? It is")


@pytest.mark.slow
def test_train_command_writes_models_reports_and_card(tmp_path, capsys):
    from engine.gguf.reader import GGUFFile
    from engine.train.cli import main

    out = tmp_path / "models"
    args = ["train", "--out-dir", str(out), "--preset", "micro", "--steps", "4", "--batch-tokens", "512",
            "--seq-len", "64", "--long-seq-len", "128", "--max-corpus-mb", "0.2", "--retrieval-examples", "6",
            "--ckpt-dir", str(tmp_path / "ckpt")]
    assert main(args) == 0
    report = json.loads((out / "luce-micro.report.json").read_text())
    assert report["training"]["steps"] == 4 and report["export"]["bytes"] == (out / "luce-micro.gguf").stat().st_size
    assert report["heldout"]["unigram_loss"] > 0 and len(report["heldout"]["routing"]) == MICRO.n_layers
    with GGUFFile(out / "luce-micro.gguf") as f:
        assert len(f.metadata["tokenizer.ggml.tokens"]) == report["vocab"]
    card = (out / "README.md").read_text()
    assert report["export"]["sha256"] in card and "luce-target.gguf" in card
    # a member's card shows the numbers of its report
    from engine.train.model_card import render

    (tmp_path / "card").mkdir()
    (tmp_path / "card" / "luce-target.report.json").write_text(json.dumps(report | {"member": "target"}))
    card = render(tmp_path / "card")
    for text in (f"{report['heldout']['loss']:.3f} nats/token", f"{report['heldout']['unigram_loss']:.3f}",
                 f"{report['training']['tokens']:,} tokens", report["export"]["sha256"], report["command"]):
        assert text in card
    assert card.count("| top-quarter share |") == 1 and "Not built yet" in card  # the drafter
    # the tokenizer is kept with the checkpoints and reused on resume
    assert (tmp_path / "ckpt" / "data" / "tokenizer.json").exists()
    assert main(args + ["--resume"]) == 0
    assert json.loads((out / "luce-micro.report.json").read_text())["training"]["resumed_from"] == 4
    capsys.readouterr()
    assert main(args[:-2] + ["--resume"]) == 2
    assert "--resume needs --ckpt-dir" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_train_command_trains_the_target_on_cuda(tmp_path):
    """The target preset for 40 steps in bf16, in a fresh process as the train command runs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from engine.engine import Engine
    from engine.train.train_target import fla_trains_on

    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "models"
    cmd = [sys.executable, "-m", "engine.train.cli", "train", "--preset", "target", "--steps", "40",
           "--batch-tokens", "65536", "--seq-len", "512", "--long-seq-len", "2048", "--max-corpus-mb", "3",
           "--retrieval-examples", "100", "--device", "cuda", "--out-dir", str(out),
           "--ckpt-dir", str(tmp_path / "ckpt")]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((out / "luce-target.report.json").read_text())
    t = report["training"]
    losses = [v for _, v in t["loss_history"]]
    assert t["steps"] == 40 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] - 1.0
    assert t["gdn_kernel"] == ("fla" if fla_trains_on(torch.device("cuda")) else "torch")
    assert report["heldout"]["loss"] < report["heldout"]["unigram_loss"]
    assert report["export"]["bytes"] <= TARGET_BUDGET_BYTES
    eng = Engine.from_gguf(out / "luce-target.gguf", device="cuda")
    ids = eng.tokenizer.encode("def main():\n    ")
    assert torch.isfinite(eng.logits(ids)).all()
    assert len(eng.generate(ids, 16).ids) == 16


def test_measure_niah_finds_the_needle_with_the_shipped_target(tmp_path):
    """The report's NIAH measure runs the exported file through the engine and scores it."""
    from pathlib import Path

    from engine.train.corpus import SourceFile, write_documents
    from engine.train.pipeline import measure_niah

    target = Path(__file__).resolve().parents[3] / "models" / "luce-target.gguf"
    text = "import os\n\n\ndef walk(root):\n    for name in os.listdir(root):\n        yield name\n" * 120
    hay = tmp_path / "held_out.txt"
    write_documents(hay, [SourceFile("a.py", text).text])
    report = measure_niah(target, hay, device=torch.device("cpu"), cases=3, seed=0, contexts=(512,))
    (row,) = report["rows"]
    assert row["context"] == 512 and row["cases"] == 3
    assert row["accuracy"] == 1.0 and row["missed_depths"] == []
    assert report["haystack"] == "held_out.txt"
