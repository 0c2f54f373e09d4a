"""Training rows: corpus windows with fresh target passes; distilled sequences drawn epoch by
epoch, each sent through the target once, whose engine labels agree with the generated tokens."""

import pytest
import torch

from engine.dflash import train_rows
from engine.dflash.distill import DistillOptions, distill
from engine.dflash.train_rows import CorpusRows, DistilledRows, target_pass, target_passes
from engine.train.batches import BatchSampler, TokenStream

LAYERS = (1, 3)


def assert_same_pass(features, labels, ref_features, ref_labels):
    """A batched pass against one row's own forward: float32 features to summation order (up to 3.6e-5
    of the largest seen on this CPU, through 70 tokens of recurrence), the same labels."""
    assert float((features - ref_features).abs().max() / ref_features.abs().max()) < 1e-4
    assert torch.equal(labels, ref_labels)


def _stream():
    gen = torch.Generator().manual_seed(0)
    return TokenStream.from_documents([torch.randint(0, 2000, (n,), generator=gen).tolist() for n in (200, 300)])


def test_corpus_rows_are_sampler_windows_with_their_target_passes(target):
    sampler = BatchSampler(_stream(), None, batch_tokens=3 * 19, example_share=0.0, seed=4)
    rows = CorpusRows(target, sampler, 20, LAYERS, "target").batch(5)
    assert rows.ids.shape == (3, 20) and rows.first_anchor == 1
    assert torch.equal(rows.ids, sampler.batch(5, 19))
    for r in range(3):
        assert_same_pass(rows.features[r], rows.labels[r], *target_pass(target, rows.ids[r], LAYERS, "target"))
    assert not rows.features.is_inference()  # autograd may save it


def test_distilled_rows_cover_every_sequence_once_per_epoch_and_pass_each_once(target, target_path, monkeypatch):
    sequences = distill(target_path, _stream(), DistillOptions(5, 8, 10, seed=1), device="cpu")
    calls = []
    real = train_rows.target_passes
    monkeypatch.setattr(train_rows, "target_passes", lambda m, ids, *a: calls.append(ids.clone()) or real(m, ids, *a))
    rows = DistilledRows(target, sequences, 8, LAYERS, "target", batch=2, seed=3)
    drawn = [rows.indices(step) for step in range(5)]
    flat = torch.cat(drawn)
    assert sorted(flat[:5].tolist()) == list(range(5)) and sorted(flat[5:].tolist()) == list(range(5))
    assert not torch.equal(flat[:5], flat[5:])  # each epoch its own order
    assert torch.equal(rows.indices(3), drawn[3])  # a step's rows depend on the step alone

    for step in range(5):
        batch = rows.batch(step)
        assert batch.first_anchor == 8 and torch.equal(batch.ids, sequences[drawn[step]])
        for r, i in enumerate(drawn[step].tolist()):
            assert_same_pass(batch.features[r], batch.labels[r], *target_pass(target, sequences[i], LAYERS, "target"))
    # each sequence through the target once over two epochs, a step's new rows in one batched pass
    assert sorted(torch.cat(calls).tolist()) == sorted(sequences.tolist()) and rows.passes == 5
    assert len(calls) <= 3
    assert rows.agreement == 1.0  # float32 on the CPU: the engine picks every generated token


def test_agreement_measures_disagreement(target):
    sequences = torch.randint(0, 2000, (2, 12), generator=torch.Generator().manual_seed(5))
    rows = DistilledRows(target, sequences, 4, LAYERS, "target", batch=2, seed=0)
    rows.batch(0)
    assert rows.compared == 16 and rows.agreement < 0.5  # random tokens are not the target's choices
    corpus_labels = DistilledRows(target, sequences, 4, LAYERS, "corpus", batch=2, seed=0)
    assert torch.equal(corpus_labels.batch(0).labels, sequences[corpus_labels.indices(0)])
    assert corpus_labels.agreement != corpus_labels.agreement  # nan: nothing compared


def test_rows_forward_equals_each_rows_own_forward(target):
    """``forward_rows``: token-wise work over every row at once, attention causal within each row,
    each row its own Gated DeltaNet recurrence and conv; against one forward per row, for a length
    under and over the recurrent/chunked switch and one not a whole number of chunks."""
    gen = torch.Generator().manual_seed(7)
    for length in (5, 37, 70):
        ids = torch.randint(0, target.cfg.vocab, (3, length), generator=gen)
        final, hidden = target.forward_rows(ids, capture_layers=(0, 2, target.cfg.n_layers - 1))
        for r in range(3):
            out = target.forward(ids[r], target.new_state(length), capture_layers=(0, 2, target.cfg.n_layers - 1),
                                 logits="none")
            for got, want in [(final[r], out.final_hidden)] + [(hidden[i][r], out.hidden[i]) for i in out.hidden]:
                assert float((got - want).abs().max() / want.abs().max()) < 1e-4, length  # summation order


def test_batched_passes_split_by_tokens_and_refuse_bad_shapes(target, monkeypatch):
    ids = torch.randint(0, target.cfg.vocab, (5, 11), generator=torch.Generator().manual_seed(2))
    whole = target_passes(target, ids, LAYERS, "target")
    monkeypatch.setattr(train_rows, "PASS_TOKENS", 25)  # two rows a forward, the last alone
    forwards = []
    real = target.forward_rows
    monkeypatch.setattr(target, "forward_rows", lambda part, **kw: forwards.append(len(part)) or real(part, **kw))
    split = target_passes(target, ids, LAYERS, "target")
    assert forwards == [2, 2, 1]
    assert torch.equal(split[1], whole[1]) and float((split[0] - whole[0]).abs().max() / whole[0].abs().max()) < 1e-4
    corpus = target_passes(target, ids, LAYERS, "corpus")
    assert torch.equal(corpus[1], ids)
    from engine.model.gated_deltanet import gdn_rows

    x = torch.zeros(7, target.cfg.hidden)
    with pytest.raises(ValueError, match="7 tokens do not split into 2 rows"):
        gdn_rows(target.weights.layers[0].mixer, x, 2, target.cfg, target.delta_rule)
    for bad in (ids[0], ids[:, :0]):
        with pytest.raises(ValueError, match="non-empty \\[rows, length\\]"):
            target.forward_rows(bad)
