"""Training rows: corpus windows with fresh target passes; distilled sequences drawn epoch by
epoch, each sent through the target once, whose engine labels agree with the generated tokens."""

import torch

from engine.dflash import train_rows
from engine.dflash.distill import DistillOptions, distill
from engine.dflash.train_rows import CorpusRows, DistilledRows, target_pass
from engine.train.batches import BatchSampler, TokenStream

LAYERS = (1, 3)


def _stream():
    gen = torch.Generator().manual_seed(0)
    return TokenStream.from_documents([torch.randint(0, 2000, (n,), generator=gen).tolist() for n in (200, 300)])


def test_corpus_rows_are_sampler_windows_with_their_target_passes(target):
    sampler = BatchSampler(_stream(), None, batch_tokens=3 * 19, example_share=0.0, seed=4)
    rows = CorpusRows(target, sampler, 20, LAYERS, "target").batch(5)
    assert rows.ids.shape == (3, 20) and rows.first_anchor == 1
    assert torch.equal(rows.ids, sampler.batch(5, 19))
    for r in range(3):
        features, labels = target_pass(target, rows.ids[r], LAYERS, "target")
        torch.testing.assert_close(rows.features[r], features, rtol=0, atol=0)
        assert torch.equal(rows.labels[r], labels)
    assert not rows.features.is_inference()  # autograd may save it


def test_distilled_rows_cover_every_sequence_once_per_epoch_and_pass_each_once(target, target_path, monkeypatch):
    sequences = distill(target_path, _stream(), DistillOptions(5, 8, 10, seed=1), device="cpu")
    calls = []
    real = train_rows.target_pass
    monkeypatch.setattr(train_rows, "target_pass", lambda m, ids, *a: calls.append(ids.clone()) or real(m, ids, *a))
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
            features, labels = real(target, sequences[i], LAYERS, "target")
            torch.testing.assert_close(batch.features[r], features, rtol=0, atol=0)
            assert torch.equal(batch.labels[r], labels)
    assert len(calls) == 5 and rows.passes == 5  # one pass per sequence over two epochs
    assert rows.agreement == 1.0  # float32 on the CPU: the engine picks every generated token


def test_agreement_measures_disagreement(target):
    sequences = torch.randint(0, 2000, (2, 12), generator=torch.Generator().manual_seed(5))
    rows = DistilledRows(target, sequences, 4, LAYERS, "target", batch=2, seed=0)
    rows.batch(0)
    assert rows.compared == 16 and rows.agreement < 0.5  # random tokens are not the target's choices
    corpus_labels = DistilledRows(target, sequences, 4, LAYERS, "corpus", batch=2, seed=0)
    assert torch.equal(corpus_labels.batch(0).labels, sequences[corpus_labels.indices(0)])
    assert corpus_labels.agreement != corpus_labels.agreement  # nan: nothing compared
