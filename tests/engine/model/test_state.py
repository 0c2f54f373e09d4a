"""ModelState: preallocated KV caches, clone / copy_from rollback, crop, and limits."""

import pytest
import torch

from engine.errors import ConfigError
from engine.model.state import KVCache


def test_kv_cache_append_and_crop():
    cache = KVCache.empty(2, 5, 3, device="cpu", dtype=torch.float32)
    k, v = torch.randn(2, 3, 3), torch.randn(2, 3, 3)
    keys, values = cache.append(k, v)
    assert keys.shape == (2, 3, 3) and torch.equal(keys, k) and torch.equal(values, v)
    cache.crop(1)
    keys, _ = cache.append(k[:, :2], v[:, :2])
    assert cache.length == 3 and torch.equal(keys[:, 1:], k[:, :2])
    with pytest.raises(ConfigError, match="at most 5"):
        cache.append(torch.randn(2, 3, 3), torch.randn(2, 3, 3))
    with pytest.raises(ValueError):
        cache.crop(4)


def test_new_state_layout(engine_model):
    state = engine_model.new_state(16)
    cfg = engine_model.cfg
    assert sorted(state.kv) == [3, 7] and sorted(state.conv) == [0, 1, 2, 4, 5, 6]
    assert state.conv[0].shape == (cfg.gdn_conv_dim, cfg.conv_kernel - 1)
    assert state.recurrent[0].shape == (4, 16, 16) and state.recurrent[0].dtype == torch.float32
    assert state.kv[3].k.shape == (2, 16, 32) and state.max_len == 16


def test_snapshot_and_rollback_reproduce_the_same_logits(engine_model):
    ids = torch.randint(0, 101, (30,), generator=torch.Generator().manual_seed(4))
    state = engine_model.new_state(40)
    engine_model.forward(ids[:20], state)
    snapshot = state.clone()
    first = engine_model.forward(ids[20:30], state).logits
    assert state.seq_len == 30 and snapshot.seq_len == 20
    state.copy_from(snapshot)  # roll back the 10 tokens
    assert state.seq_len == 20 and state.kv[3].length == 20 and state.next_position == 20
    again = engine_model.forward(ids[20:30], state).logits
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_explicit_positions_advance_the_next_position(engine_model):
    state = engine_model.new_state(8)
    engine_model.forward(torch.tensor([1, 2, 3]), state, positions=[0, 5, 9], logits="none")
    assert state.seq_len == 3 and state.next_position == 10
    with pytest.raises(ValueError, match="positions"):
        engine_model.forward(torch.tensor([1, 2]), state, positions=[1])


def test_overfull_state_is_refused_before_anything_changes(engine_model):
    state = engine_model.new_state(4)
    engine_model.forward(torch.tensor([1, 2, 3]), state, logits="none")
    before = state.clone()
    with pytest.raises(ConfigError, match="do not fit"):
        engine_model.forward(torch.tensor([4, 5]), state)
    assert state.seq_len == 3
    torch.testing.assert_close(state.recurrent[0], before.recurrent[0], rtol=0, atol=0)


def test_capture_layers_returns_residual_stream(engine_model):
    ids = torch.tensor([5, 6, 7, 8])
    out = engine_model.forward(ids, engine_model.new_state(4), capture_layers=(1, 7))
    assert sorted(out.hidden) == [1, 7] and out.hidden[1].shape == (4, 64)
    # the last layer's output, normed, is the output head's input
    w = engine_model.weights
    h = out.hidden[7]
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w.output_norm
    torch.testing.assert_close(out.final_hidden, normed, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.logits, normed @ w.output.T, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="capture_layers"):
        engine_model.forward(ids, engine_model.new_state(4), capture_layers=(8,))
