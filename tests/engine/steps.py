"""A captured decode step followed teacher-forced against a plain model, for the hybrid executor's CUDA tests."""

import torch

from engine.model.decode_graph import DecodeGraph


def rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def follow_captured(plain, model, bound, *, before=None, prompt=7, tokens=12):
    """Prefill ``prompt`` random tokens into both models, capture ``model``'s decode step, call ``before()``
    (if given), then feed ``tokens`` more: each step's logits within ``bound`` of ``plain``'s (relative to
    their largest magnitude). Returns the captured step."""
    ids = torch.randint(0, 256, (prompt + tokens,), generator=torch.Generator().manual_seed(6)).cuda()
    eager, static = plain.new_state(prompt + tokens + 5), model.new_state(prompt + tokens + 5)
    plain.forward(ids[:prompt], eager, logits="none")
    model.forward(ids[:prompt], static, logits="none")
    step = DecodeGraph(model, static, graph=True)
    assert step.captured
    if before is not None:
        before()
    for t in range(prompt, prompt + tokens):
        ref = plain.forward(ids[t:t + 1], eager, logits="last").logits
        assert rel_err(step.step(ids[t:t + 1]), ref) < bound, f"token {t}"
    return step
