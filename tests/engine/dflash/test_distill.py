"""Self-distilled rows: seeded prompts, the HF module's greedy continuations equal the engine's
plain greedy decoding, the cache beside the draft is reused only for the same settings."""

import pytest
import torch

from engine.dflash.distill import DistillOptions, agreement, cache_path, distill, draw_prompts, greedy_continuations
from engine.errors import ConfigError
from engine.gguf.to_hf import hf_model_from_gguf
from engine.train.batches import TokenStream

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def stream():
    gen = torch.Generator().manual_seed(0)
    return TokenStream.from_documents([torch.randint(0, 2000, (n,), generator=gen).tolist() for n in (300, 50, 400)])


def test_options_are_validated():
    assert DistillOptions(4, 8, 16).seq_len == 24
    with pytest.raises(ValueError, match="distill sequences must be positive, got 0"):
        DistillOptions(0, 8, 16)
    with pytest.raises(ValueError, match="new_tokens must be at least 2"):
        DistillOptions(4, 8, 1)


def test_prompts_are_seeded_windows_of_the_stream(stream):
    a = draw_prompts(stream, 20, 16, seed=1)
    assert a.shape == (20, 16) and a.dtype == torch.long
    assert torch.equal(a, draw_prompts(stream, 20, 16, seed=1))
    assert not torch.equal(a, draw_prompts(stream, 20, 16, seed=2))
    ids = stream.ids.long()
    for row in a:  # every row is a contiguous window, none wrapping past the end
        starts = [o for o in range(len(ids) - 15) if torch.equal(ids[o:o + 16], row)]
        assert starts
    with pytest.raises(ConfigError, match="fewer than one distillation prompt of 800"):
        draw_prompts(stream, 2, 800, seed=0)


def test_batched_continuations_are_the_engines_greedy_decoding(target, target_path, plain, stream):
    prompts = draw_prompts(stream, 5, 12, seed=3)
    seen = []
    out = greedy_continuations(hf_model_from_gguf(target_path), prompts, 20, batch=2,
                               progress=lambda done, total, m: seen.append((done, total)))
    assert out.shape == (5, 32) and torch.equal(out[:, :12], prompts)
    assert seen == [(2, 5), (4, 5), (5, 5)]
    for row, prompt in zip(out, prompts):
        assert row[12:].tolist() == plain(target, prompt.tolist(), 20)


def test_cache_is_reused_only_for_the_same_settings(target_path, stream, tmp_path, monkeypatch):
    cache = cache_path(tmp_path / "d.gguf")
    assert cache.name == "d.gguf.distill.pt"
    opts = DistillOptions(3, 10, 6, batch=8, seed=0)
    first = distill(target_path, stream, opts, device="cpu", cache=cache)
    assert first.shape == (3, 16) and cache.is_file()

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded although the cache holds these sequences")

    monkeypatch.setattr("engine.gguf.to_hf.hf_model_from_gguf", refuse)
    assert torch.equal(distill(target_path, stream, DistillOptions(3, 10, 6, batch=2, seed=0), device="cpu",
                               cache=cache), first)  # the generation batch does not change the sequences
    for changed in (DistillOptions(3, 10, 7), DistillOptions(3, 10, 6, seed=1), DistillOptions(4, 10, 6)):
        with pytest.raises(AssertionError, match="the target was loaded"):
            distill(target_path, stream, changed, device="cpu", cache=cache)
    cache.write_bytes(b"not a torch file")
    with pytest.raises(AssertionError, match="the target was loaded"):
        distill(target_path, stream, opts, device="cpu", cache=cache)


def test_agreement_counts_generated_positions_only():
    ids = torch.tensor([1, 2, 3, 4, 5, 6])
    labels = torch.tensor([9, 9, 3, 4, 0, 6])
    assert agreement(labels, ids, 2) == (3, 4)
