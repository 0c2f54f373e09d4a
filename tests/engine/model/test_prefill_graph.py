"""The padded prefill (engine.model.prefill_graph) against the plain forward.

A prompt padded at its end to a bucket's length must give the plain forward's last logits and leave
the same KV caches (over the real tokens), conv and recurrent states; on the CPU it runs eagerly, on
CUDA it is captured and replayed for prompts of several lengths. Bounds as in test_decode_graph.py:
float32, logits within 1e-4 of the largest logit and states within 1e-5 of their largest entry (the
attention and the chunked delta rule see longer matrices, summed in other orders). On CUDA the captured
replay must equal the same padded prefill run eagerly (the same kernels at the same shapes), and its
logits the plain forward's within 2e-3: fla's chunk kernel forms its products in reduced precision
(about 1e-3 relative in float32 on an H200, engine.model.gated_deltanet.DeltaRule), and the plain
forward's matrices have other shapes. The states are not compared with the plain forward's there: in
this random model a token whose top-k experts nearly tie switches experts under such differences (the
H200 saw a key 2.6% off in one run while the logits agreed within 2e-3).
"""

import pytest
import torch

from engine.model.gated_deltanet import PadMask, causal_conv
from engine.model.prefill_graph import BUCKETS, PrefillGraph, bucket_for

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LOGITS_TOL = 1e-4
STATE_TOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _assert_same(model, ids, logits, state, logits_tol=LOGITS_TOL, state_tol=STATE_TOL):
    ref_state = model.new_state(ids.numel() + 1)
    ref = model.forward(ids, ref_state, logits="last").logits[-1]
    assert _rel(logits, ref) < logits_tol
    T = ids.numel()
    assert state.seq_len == state.next_position == T
    for i, c in ref_state.kv.items():
        mine = state.kv[i]
        assert mine.length == c.length == T
        assert _rel(mine.k[:, :T], c.k[:, :T]) < state_tol and _rel(mine.v[:, :T], c.v[:, :T]) < state_tol
    for i in ref_state.conv:
        assert _rel(state.conv[i], ref_state.conv[i]) < state_tol
        assert _rel(state.recurrent[i], ref_state.recurrent[i]) < state_tol
    return ref_state


def test_buckets():
    assert bucket_for(1) == BUCKETS[0] and bucket_for(64) == 64 and bucket_for(65) == 96
    assert bucket_for(BUCKETS[-1]) == BUCKETS[-1] and bucket_for(BUCKETS[-1] + 1) is None
    assert list(BUCKETS) == sorted(set(BUCKETS))
    # padding adds at most half the real tokens past the first length
    assert all(b <= 1.5 * a + 1e-9 or b <= 2 * a and a == BUCKETS[0] for a, b in zip(BUCKETS, BUCKETS[1:]))


def test_conv_keeps_the_columns_up_to_the_last_real_input():
    g = torch.Generator().manual_seed(0)
    x, state, w = torch.randn(9, 5, generator=g), torch.randn(5, 3, generator=g), torch.randn(5, 4, generator=g)
    pad = PadMask.empty(9, 4, "cpu")
    pad.set(6)
    out, kept = causal_conv(x, state, w, pad.conv_keep)
    ref_out, ref_state = causal_conv(x[:6], state, w)
    assert torch.equal(kept, ref_state) and torch.allclose(out[:6], ref_out)
    with pytest.raises(ValueError, match="real tokens"):
        pad.set(10)


@pytest.mark.parametrize("T", [5, 33, 64])
def test_padded_prefill_equals_the_plain_forward(engine_model, T):
    """Prompts shorter than the padded length (5 and 33 of 64) and one that fills it; the same object
    runs them one after another (each starts from an empty state)."""
    step = PrefillGraph(engine_model, 64, graph=False)
    ids = torch.randint(0, engine_model.cfg.vocab, (T,), generator=torch.Generator().manual_seed(T))
    other = torch.randint(0, engine_model.cfg.vocab, (40,), generator=torch.Generator().manual_seed(99))
    step.run(other)  # a longer prompt first: nothing of it may remain
    logits, state = step.run(ids)
    ref_state = _assert_same(engine_model, ids, logits, state)
    # decoding continues from it as from the plain prefill's state
    nxt = torch.tensor([7])
    mine = engine_model.new_state(T + 2)
    mine.copy_from(state)
    a = engine_model.forward(nxt, mine, logits="last").logits[-1]
    b = engine_model.forward(nxt, ref_state, logits="last").logits[-1]
    assert _rel(a, b) < LOGITS_TOL


def test_padded_prefills_share_one_state(engine_model):
    """Two padded lengths on one state of the longer's capacity give what each gives on its own; a state
    shorter than the length is refused."""
    shared = engine_model.new_state(64)
    short = PrefillGraph(engine_model, 16, graph=False, state=shared)
    long = PrefillGraph(engine_model, 64, graph=False, state=shared)
    ids = torch.randint(0, engine_model.cfg.vocab, (12,), generator=torch.Generator().manual_seed(5))
    long.run(torch.randint(0, engine_model.cfg.vocab, (50,), generator=torch.Generator().manual_seed(6)))
    logits, state = short.run(ids)
    assert state is shared
    _assert_same(engine_model, ids, logits, state)
    with pytest.raises(ValueError, match="state of at least that many"):
        PrefillGraph(engine_model, 128, graph=False, state=shared)


def test_padded_prefill_refuses_prompts_past_its_length(engine_model):
    step = PrefillGraph(engine_model, 8, graph=False)
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        step.run(torch.zeros(9, dtype=torch.long))
    with pytest.raises(ValueError, match="1 to 8 tokens"):
        step.run(torch.zeros(0, dtype=torch.long))


@pytest.mark.gpu
@needs_cuda
def test_cuda_prefill_graph_replays_prompts_of_several_lengths(gguf_path):
    """Captured on CUDA (float32, the tiny model), replayed for three prompt lengths: the same logits and
    states as the padded prefill run eagerly, the plain forward's logits within 2e-3 (module docstring)."""
    from engine.gguf.reader import GGUFFile
    from engine.model.qwen35moe import Qwen35MoE

    with GGUFFile(gguf_path) as f:
        model = Qwen35MoE.from_gguf(f, device="cuda", dtype=torch.float32)
    step, eager = PrefillGraph(model, 128), PrefillGraph(model, 128, graph=False)
    assert step.captured and not eager.captured
    for T in (100, 17, 128):
        ids = torch.randint(0, model.cfg.vocab, (T,), generator=torch.Generator().manual_seed(T)).cuda()
        logits, state = step.run(ids)
        ref_logits, ref = eager.run(ids)
        assert _rel(logits, ref_logits) < 1e-6
        for i, c in ref.kv.items():
            assert _rel(state.kv[i].k[:, :T], c.k[:, :T]) < 1e-6 and _rel(state.kv[i].v[:, :T], c.v[:, :T]) < 1e-6
        for i in ref.conv:
            assert _rel(state.conv[i], ref.conv[i]) < 1e-6 and _rel(state.recurrent[i], ref.recurrent[i]) < 1e-6
        plain = model.forward(ids, model.new_state(T + 1), logits="last").logits[-1]
        assert _rel(logits, plain) < 2e-3
