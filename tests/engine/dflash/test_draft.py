"""The draft network: config checks, layer ids, attention pattern, context cache, block packing."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the Triton kernels are decorated

from engine.dflash.draft import (DFlashDraft, DraftCache, DraftConfig, FusedDraftWeights,  # noqa: E402
                                 block_hidden, default_layer_ids, in_cache_blocker)

TOL = dict(atol=1e-5, rtol=1e-5)


def _cfg(**overrides):
    kw = dict(n_layers=2, hidden=32, ffn=48, n_head=4, n_head_kv=2, head_dim=8, rms_eps=1e-6, rope_theta=1e4,
              block_size=4, mask_token_id=0, target_layer_ids=(1, 3), vocab=50)
    return DraftConfig(**(kw | overrides))


def _draft(**overrides):
    return DFlashDraft(_cfg(**overrides)).init_random(torch.Generator().manual_seed(0), std=0.2)


def test_layer_ids_follow_the_published_rule():
    assert default_layer_ids(40, 5) == (1, 10, 19, 28, 37)
    assert default_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert default_layer_ids(4, 2) == (1, 1)  # tiny targets clamp, never leave the target
    assert default_layer_ids(40, 1) == (20,)


@pytest.mark.parametrize("overrides, message", [
    ({"block_size": 1}, "block_size must be at least 2"),
    ({"n_head_kv": 3}, "not a multiple of n_head_kv"),
    ({"mask_token_id": 50}, "mask_token_id 50 is outside the vocabulary of 50"),
    ({"target_layer_ids": ()}, "target_layer_ids must be non-negative"),
    ({"swa_layers": (True,)}, "swa_layers has 1 entries for 2 layers"),
    ({"rope_dim": 6, "head_dim": 4}, "rope_dim 6 must be even and at most head_dim 4"),
])
def test_config_is_validated(overrides, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**overrides)


def test_rope_dim_defaults_to_the_whole_head():
    assert _cfg().rope_dim == 8 and _cfg(rope_dim=4).rope_dim == 4


def _run(draft, x, start, features):
    cache = DraftCache.empty(draft, 32)
    cache.extend(draft, features, torch.arange(features.shape[0]))
    return block_hidden(draft, cache, x, start)


def test_block_attention_is_non_causal_unless_configured():
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(6, 64, generator=gen)
    x = torch.randn(4, 32, generator=gen)
    x2 = x.clone()
    x2[3] += 1.0  # only the last slot changes
    for causal in (False, True):
        draft = _draft(causal=causal)
        a, b = _run(draft, x, 6, features), _run(draft, x2, 6, features)
        first_slot_moved = (a[0] - b[0]).abs().max().item()
        if causal:
            assert first_slot_moved < 1e-6
        else:
            assert first_slot_moved > 1e-3


def test_context_cache_extended_in_pieces_equals_one_extension():
    draft = _draft()
    gen = torch.Generator().manual_seed(2)
    features = torch.randn(9, 64, generator=gen)
    x = torch.randn(4, 32, generator=gen)
    whole = _run(draft, x, 9, features)
    cache = DraftCache.empty(draft, 32)
    for lo, hi in ((0, 2), (2, 7), (7, 9)):
        cache.extend(draft, features[lo:hi], torch.arange(lo, hi))
    torch.testing.assert_close(block_hidden(draft, cache, x, 9), whole, **TOL)
    with pytest.raises(ValueError, match="holds 32 context rows; 41 were asked for"):
        cache.extend(draft, torch.randn(32, 64), torch.arange(9, 41))


def test_sliding_window_hides_far_context():
    draft = _draft(sliding_window=3)
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(10, 64, generator=gen)
    x = torch.randn(4, 32, generator=gen)
    base = _run(draft, x, 10, features)
    far, near = features.clone(), features.clone()
    far[0] += 5.0  # position 0 is more than 3 away from every block slot (10..13)
    near[9] += 5.0
    torch.testing.assert_close(_run(draft, x, 10, far), base, **TOL)
    assert (_run(draft, x, 10, near) - base).abs().max() > 1e-3


def test_packed_blocks_equal_separate_blocks():
    """Training packs blocks with a visibility mask; each must equal a lone block with its own context."""
    draft = _draft()
    gen = torch.Generator().manual_seed(4)
    L, B = 12, 4
    features = torch.randn(L, 64, generator=gen)
    anchors = [3, 8]
    x = torch.randn(2 * B, 32, generator=gen)
    positions = torch.cat([torch.arange(a, a + B) for a in anchors])
    ctx_pos = torch.arange(L)
    sees = torch.stack([ctx_pos < a for a in anchors]).repeat_interleave(B, 0)  # [2B, L]
    same = torch.block_diag(torch.ones(B, B), torch.ones(B, B)).bool()
    packed = draft(x, positions, draft.project_context(features, ctx_pos), ctx_pos, torch.cat([sees, same], 1))
    for j, a in enumerate(anchors):
        alone = _run(draft, x[j * B:(j + 1) * B], a, features[:a])
        torch.testing.assert_close(packed[j * B:(j + 1) * B], alone, **TOL)


def test_output_is_normed_and_trainable():
    draft = _draft()
    gen = torch.Generator().manual_seed(5)
    features = torch.randn(5, 64, generator=gen)
    ctx_pos = torch.arange(5)
    out = draft(torch.randn(4, 32, generator=gen), torch.arange(5, 9), draft.project_context(features, ctx_pos),
                ctx_pos)
    rms = out.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(4), atol=1e-3, rtol=0)  # final norm with unit weight
    F.mse_loss(out, torch.zeros_like(out)).backward()
    assert all(p.grad is not None for p in draft.parameters())


@pytest.mark.parametrize("causal", [False, True])
def test_rows_of_a_batch_equal_separate_calls(causal):
    """A leading row dimension runs independent rows at once: each equals its own call, and a mask
    (which makes grouped-query heads expand to whole heads) changes nothing where it hides nothing."""
    draft = _draft(causal=causal)
    gen = torch.Generator().manual_seed(6)
    R, L, T = 3, 7, 4
    features = torch.randn(R, L, 64, generator=gen)
    ctx_pos = torch.arange(L).expand(R, L)
    x = torch.randn(R, T, 32, generator=gen)
    positions = torch.arange(L, L + T) + torch.arange(R)[:, None]  # rows at different offsets
    context = draft.project_context(features, ctx_pos)
    assert context[0][0].shape == (R, 2, L, 8)
    visible = torch.ones(R, T, L + T, dtype=torch.bool)
    batched = draft(x, positions, context, ctx_pos, visible)
    assert batched.shape == (R, T, 32)
    for r in range(R):
        alone = draft(x[r], positions[r], draft.project_context(features[r], ctx_pos[r]), ctx_pos[r])
        torch.testing.assert_close(batched[r], alone, **TOL)


@pytest.mark.parametrize("overrides", [{}, {"causal": True}, {"sliding_window": 3}])
@pytest.mark.parametrize("tokens", [2, 4])
def test_fixed_shape_draft_step_proposes_the_eager_block(overrides, tokens):
    """``DraftStep`` attends over the whole preallocated cache under a mask from its length: the
    same proposals as ``block_hidden`` over the cache's rows, as the cache grows."""
    from engine.dflash.draft_step import DraftStep

    draft = _draft(**overrides)
    gen = torch.Generator().manual_seed(7)
    embed, output = torch.randn(50, 32, generator=gen), torch.randn(50, 32, generator=gen)
    cache = DraftCache.empty(draft, 16)
    step = DraftStep(draft, cache, embed, output, tokens=tokens, graph=False)
    assert step.path == "static"
    start = 0
    for rows, token in ((5, 3), (1, 17), (3, 42)):
        cache.extend(draft, torch.randn(rows, 64, generator=gen), torch.arange(start, start + rows))
        start += rows
        block = torch.full((tokens,), draft.cfg.mask_token_id)
        block[0] = token
        ref = F.linear(block_hidden(draft, cache, F.embedding(block, embed), start)[1:], output).argmax(-1)
        assert torch.equal(step.step(torch.tensor(token), start), ref)
    with pytest.raises(ValueError, match="a block of 2 to 4 tokens"):
        DraftStep(draft, cache, embed, output, tokens=5, graph=False)


@pytest.mark.parametrize("variant", ["torch", "fused", "causal"])
def test_fixed_shape_context_extension_counts_only_the_kept_rows(monkeypatch, variant):
    """``DraftStep.write_block`` writes every row of the verify block's context buffers at slots from
    the cache length (before the acceptance is known) and ``count`` counts the kept ones in: the cache's rows,
    positions and proposals then equal an eager ``DraftCache.extend`` of the kept rows alone, block after block.
    A full-attention draft writes through ``write_context`` (merged k/v products; ``fused``: the norm + RoPE +
    cache write launch, on CUDA where there is one, else under the Triton interpreter), a causal one through
    ``project_context`` and copies."""
    from engine.dflash.draft_step import DraftStep

    tol, writes = TOL, []
    if variant == "fused":
        pytest.importorskip("triton")
        from engine.kernels import rope_norm
        from engine.model import attention

        monkeypatch.setattr(attention, "FUSED_ROPE", True)
        tol = dict(atol=1e-5, rtol=1e-4)
        kernel = rope_norm.norm_rope_to_cache_triton
        monkeypatch.setattr(rope_norm, "norm_rope_to_cache_triton", lambda *a: writes.append(1) or kernel(*a))
    dev = "cuda" if variant == "fused" and torch.cuda.is_available() else "cpu"  # the interpreter runs CPU tensors
    draft, tokens = _draft(head_dim=16, rope_dim=8, causal=variant == "causal").to(dev), 4
    gen = torch.Generator().manual_seed(11)
    embed, output = torch.randn(50, 32, generator=gen).to(dev), torch.randn(50, 32, generator=gen).to(dev)
    context = {i: torch.zeros(tokens, 32, device=dev) for i in (1, 3)}
    fixed, eager = DraftCache.empty(draft, 13), DraftCache.empty(draft, 13)
    step = DraftStep(draft, fixed, embed, output, tokens=tokens, graph=False, context=context)
    start = 0
    for keep in (4, 1, 3, 2):  # 10 rows kept; each block writes all 4
        for buf in context.values():
            buf.copy_(torch.randn(tokens, 32, generator=gen).to(dev))
        before = fixed.length
        launches = len(writes)
        assert step.write_block(start) and fixed.length == before  # written, nothing counted yet
        assert len(writes) - launches == (draft.cfg.n_layers if variant == "fused" else 0)  # one launch a layer
        with pytest.raises(ValueError, match="keep must be 1..4"):
            step.count(tokens + 1)
        step.count(keep)
        features = torch.cat([context[1], context[3]], dim=-1)[:keep]
        eager.extend(draft, features, torch.arange(start, start + keep, device=dev))
        start += keep
        n = eager.length
        assert fixed.length == n
        assert torch.equal(fixed.positions[:n], eager.positions[:n])
        for a, b in zip(fixed.k + fixed.v, eager.k + eager.v):
            torch.testing.assert_close(a[:, :n], b[:, :n], **tol)
        seven = torch.tensor(7, device=dev)
        assert torch.equal(step.step(seven, start),
                           DraftStep(draft, eager, embed, output, tokens=tokens, graph=False).step(seven, start))
    assert not step.extend(start, 1) and fixed.length == 10  # 4 more rows would pass the 13 slots
    plain = DraftStep(draft, fixed, embed, output, tokens=tokens, graph=False)
    assert not plain.extend(0, 1)  # no context buffers: the caller extends eagerly
    with pytest.raises(ValueError, match="must hold 4 rows of target layers"):
        DraftStep(draft, fixed, embed, output, tokens=tokens, graph=False, context={1: torch.zeros(4, 32)})


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tokens", [3, 5])
def test_block_in_cache_equals_the_masked_block(monkeypatch, fused, tokens):
    """``forward_in_cache`` (the block's keys written past the context, one mask over the cache)
    gives ``block_hidden``'s hidden states, with the torch kernels and with the engine's fused
    ones (add + norm, norm + RoPE with the cache writes, split-key attention, SwiGLU) under the Triton
    interpreter; the cache's context rows are left as they were."""
    if fused:
        pytest.importorskip("triton")
        from engine.model import attention, norm

        from engine.model import moe

        for module, name in ((attention, "FUSED_DECODE_ATTENTION"), (attention, "FUSED_ROPE"),
                             (norm, "FUSED_ADD_NORM"), (moe, "FUSED_GATE")):
            monkeypatch.setattr(module, name, True)
    dev = "cuda" if fused and torch.cuda.is_available() else "cpu"  # the interpreter runs CPU tensors
    draft = _draft(head_dim=16, n_head=4, n_head_kv=2, block_size=8, rope_dim=8).to(dev)
    gen = torch.Generator().manual_seed(5)
    cache = DraftCache.empty(draft, 24)
    cache.extend(draft, torch.randn(11, 64, generator=gen).to(dev), torch.arange(11, device=dev))
    context = [(k[:, :11].clone(), v[:, :11].clone()) for k, v in zip(cache.k, cache.v)]
    x = torch.randn(tokens, 32, generator=gen).to(dev)
    ref = block_hidden(draft, cache, x, 11)
    slots = torch.arange(11, 11 + tokens, device=dev)
    visible = (torch.arange(24, device=dev) < 11 + tokens).expand(tokens, -1)
    with torch.inference_mode():
        out = draft.forward_in_cache(x, torch.arange(11, 11 + tokens, device=dev), cache, slots, visible,
                                     FusedDraftWeights.of(draft))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    for (k, v), (k0, v0) in zip(zip(cache.k, cache.v), context):
        assert torch.equal(k[:, :11], k0) and torch.equal(v[:, :11], v0)


def test_in_cache_path_is_for_full_attention_drafts_and_a_full_cache_takes_the_masked_one():
    """Causal and sliding-window drafts keep the masked path; a block that would pass the cache's
    last row runs it too, with the eager proposals."""
    from engine.dflash.draft_step import DraftStep

    assert in_cache_blocker(_cfg()) is None
    assert "causal" in in_cache_blocker(_cfg(causal=True))
    assert "sliding-window" in in_cache_blocker(_cfg(sliding_window=3))
    draft, tokens = _draft(), 4
    gen = torch.Generator().manual_seed(3)
    embed, output = torch.randn(50, 32, generator=gen), torch.randn(50, 32, generator=gen)
    cache = DraftCache.empty(draft, 8)
    step = DraftStep(draft, cache, embed, output, tokens=tokens, graph=False)
    assert step.in_cache
    cache.extend(draft, torch.randn(6, 64, generator=gen), torch.arange(6))  # 6 + 4 rows > 8
    block = torch.tensor([9, 0, 0, 0])
    ref = F.linear(block_hidden(draft, cache, F.embedding(block, embed), 6)[1:], output).argmax(-1)
    assert torch.equal(step.step(torch.tensor(9), 6), ref)
    assert cache.length == 6 and torch.equal(cache.k[0][:, 6:], torch.zeros_like(cache.k[0][:, 6:]))


def test_merged_weights_are_made_once_per_version_of_the_draft():
    """``FusedDraftWeights.of`` returns the same copies until a parameter changes in place."""
    draft = _draft()
    first = FusedDraftWeights.of(draft)
    assert FusedDraftWeights.of(draft) is first
    torch.testing.assert_close(first.qkv[0], torch.cat([draft.layers[0].q, draft.layers[0].k, draft.layers[0].v]))
    torch.testing.assert_close(first.kv[1], torch.cat([draft.layers[1].k, draft.layers[1].v]))
    with torch.no_grad():
        draft.layers[1].up.mul_(2)
    again = FusedDraftWeights.of(draft)
    assert again is not first
    torch.testing.assert_close(again.gate_up[1], torch.cat([draft.layers[1].gate, draft.layers[1].up]))
    assert "_fused_weights" not in dict(draft.named_buffers()) and "_fused_weights" not in draft.state_dict()
