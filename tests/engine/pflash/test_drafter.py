"""The drafter: its recomputed lookahead queries and its keys are the ones its attention
layers use, and a drafter with another vocabulary is refused."""

import pytest
import torch
import torch.nn.functional as F

from engine.errors import IncompatibleModelError
from engine.gguf.make_model import default_vocab_path, make_model, tokenizer_metadata
from engine.gguf.writer import write_gguf
from engine.model.config import ARCH
from engine.pflash.drafter import Drafter
from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def target_tokenizer(pflash_models):
    return Tokenizer.from_gguf(pflash_models[0])


@pytest.fixture(scope="module")
def drafter(pflash_models, target_tokenizer):
    return Drafter.from_gguf(pflash_models[1], target_vocab=target_tokenizer, device="cpu")


def test_lookahead_matches_what_attention_computes(drafter, monkeypatch):
    seen = []  # (q, k) of every attention call, as the model hands them to SDPA
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        seen.append((q[0].clone(), k[0].clone()))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    ids = torch.randint(0, drafter.cfg.vocab, (75,), generator=torch.Generator().manual_seed(0))
    queries, keys = drafter.lookahead(ids, 6)
    n_attn = len(drafter.cfg.attention_layers)
    assert n_attn == 2 and len(queries) == len(keys) == n_attn
    tail_calls = seen[-n_attn:]  # the second forward runs the 6 lookahead tokens
    cfg = drafter.cfg
    group = cfg.n_head // cfg.n_head_kv
    for q, k, (q_model, k_model) in zip(queries, keys, tail_calls):
        assert q.shape == (cfg.n_head, 6, cfg.head_dim)
        assert k.shape == (cfg.n_head_kv, 75, cfg.head_dim)
        # attention over a cache hands SDPA the query heads of a KV head as group * T rows
        # (engine.model.attention.grouped_attention): row g * T + t is head kv * group + g
        q_model = q_model.view(cfg.n_head_kv, group, 6, cfg.head_dim).reshape(cfg.n_head, 6, cfg.head_dim)
        assert (q - q_model).abs().max() < 1e-5
        assert torch.equal(k, k_model)


def test_lookahead_over_a_prompt_no_longer_than_the_lookahead(drafter):
    ids = torch.arange(5)
    queries, keys = drafter.lookahead(ids, 5)
    assert queries[0].shape[1] == 5 and keys[0].shape[1] == 5
    with pytest.raises(ValueError, match="n_look"):
        drafter.lookahead(ids, 6)


def test_drafter_with_a_smaller_vocabulary_is_refused(pflash_models, target_tokenizer, tmp_path):
    vocab = tmp_path / "vocab-small.gguf"
    write_gguf(vocab, {"general.architecture": ARCH,
                       **tokenizer_metadata(default_vocab_path(), n_ordinary=1000)}, [])
    other = make_model(tmp_path / "other.gguf", "tiny", n_layers=4, seed=9, vocab_path=vocab)
    with pytest.raises(IncompatibleModelError, match=rf"other\.gguf: .* has \d+ tokens but the target's "
                                                     rf"has {target_tokenizer.vocab_size}"):
        Drafter.from_gguf(other, target_vocab=target_tokenizer, device="cpu")


def test_drafter_whose_token_strings_differ_is_refused(pflash_models, target_tokenizer):
    tokens = list(target_tokenizer.spec.tokens)
    tokens[100], tokens[101] = tokens[101], tokens[100]
    with pytest.raises(IncompatibleModelError, match="token id 100 is"):
        Drafter.from_gguf(pflash_models[1], target_vocab=tokens, device="cpu")
