"""Rollback after a partial acceptance: the target state must equal plain decoding of the kept tokens."""

import pytest
import torch

from engine.dflash.rollback import make_rollback

@pytest.mark.parametrize("mode", ["capture", "recompute"])
@pytest.mark.parametrize("n, keep", [(5, 1), (5, 3), (5, 5), (7, 6), (2, 1)])
def test_rollback_equals_plain_decoding_of_kept_tokens(target, prompt, plain, plain_state, assert_states_equal, mode,
                                                        n, keep):
    good = plain(target, prompt, n)
    block = good[:keep] + [(t + 1) % target.cfg.vocab for t in good[keep:n]]  # wrong after the kept prefix
    max_len = len(prompt) + n + 4
    state = target.new_state(max_len)
    with torch.inference_mode():
        target.forward(torch.tensor(prompt), state, logits="none")
        rb = make_rollback(mode, target, state)
        out = rb.verify(torch.tensor(block), (0, 2))
        assert out.logits.shape == (n, target.cfg.vocab) and set(out.hidden) >= {0, 2}
        assert out.logits.argmax(-1)[:keep - 1].tolist() == good[1:keep]
        rb.rollback(keep)

    reference = plain_state(target, prompt + block[:keep], max_len)
    assert_states_equal(state, reference)
    # and decoding continues identically from both
    with torch.inference_mode():
        nxt = torch.tensor([good[keep] if keep < n else 0])
        a = target.forward(nxt, state, logits="last").logits
        b = target.forward(nxt, reference, logits="last").logits
    # logits within 1e-5 of the largest: the states' small differences (a few 1e-6) grow through the layers
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_capture_restores_the_delta_rule_of_the_model(target, prompt):
    state = target.new_state(len(prompt) + 8)
    original = target.delta_rule
    with torch.inference_mode():
        target.forward(torch.tensor(prompt), state, logits="none")
        rb = make_rollback("capture", target, state)
        rb.verify(torch.tensor([1, 2, 3]), (0,))
    assert target.delta_rule is original


def test_unknown_mode_is_refused(target):
    with pytest.raises(ValueError, match="rollback mode must be one of"):
        make_rollback("snapshot", target, target.new_state(4))
