"""The Triton scorer against its torch reference: odd shapes through the interpreter on the
CPU, 4K-32K-token prompts on CUDA."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined

from engine.pflash.score import lookahead_probs, token_scores  # noqa: E402
from engine.pflash.score_triton import lookahead_max_probs_, token_scores_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def layers(n_layers, n_head, n_kv, n_look, t, d, dtype, *, seed, needles=()):
    """Random queries and keys (logits about N(0, 1)). In the first layer each needle key
    points along the mean query of its group, strongly enough (logits near 10) to stand out
    of 32K random keys; the other layers stay random, so most scores come from them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(n_layers):
        q = torch.randn(n_head, n_look, d, generator=gen)
        k = torch.randn(n_kv, t, d, generator=gen)
        for j in needles if layer == 0 else ():
            mean = q.reshape(n_kv, -1, d).mean(1)
            k[:, j] = 80 * mean / mean.norm(dim=-1, keepdim=True)
        out.append((q.to(DEVICE, dtype), k.to(DEVICE, dtype)))
    return [q for q, _ in out], [k for _, k in out]


def check_close(got, ref, rtol, atol):
    """Elementwise |got - ref| <= rtol * ref + atol (scores are probabilities, all >= 0)."""
    err = (got - ref).abs()
    worst = (err - rtol * ref).max().item()
    assert worst <= atol, f"max abs error {err.max().item():.3g}, max rel error {(err / ref).max().item():.3g}"


@pytest.mark.parametrize("n_head, n_kv, n_look, t, d", [
    (6, 2, 5, 77, 40),  # group of 3 heads, 5 queries: both padded
    (3, 1, 1, 33, 24),  # a single lookahead query
    (4, 4, 8, 130, 64),  # no grouping
    (8, 2, 8, 201, 136),  # head dim over one BLOCK_D
])
def test_triton_matches_reference_at_odd_sizes(n_head, n_kv, n_look, t, d):
    qs, ks = layers(2, n_head, n_kv, n_look, t, d, torch.float32, seed=t, needles=(t // 3,))
    ref = token_scores(qs, ks)
    got = token_scores_triton(qs, ks, block_n=32)
    check_close(got, ref, rtol=1e-4, atol=1e-7)


def test_layer_fold_keeps_the_running_maximum_and_reads_strided_keys():
    qs, ks = layers(1, 4, 2, 3, 50, 16, torch.float32, seed=5)
    cache = torch.zeros(2, 64, 16, device=DEVICE)  # a KV cache longer than the prompt
    cache[:, :50] = ks[0]
    out = torch.full((3, 50), 0.5, device=DEVICE)
    lookahead_max_probs_(out, qs[0], cache[:, :50], block_n=16)
    expected = torch.maximum(lookahead_probs(qs[0], ks[0]).amax(0), torch.tensor(0.5, device=DEVICE))
    assert (out - expected).abs().max() < 1e-6


def test_bad_output_buffer_is_refused():
    qs, ks = layers(1, 2, 2, 2, 20, 16, torch.float32, seed=6)
    with pytest.raises(ValueError, match="out must be float32"):
        lookahead_max_probs_(torch.zeros(2, 21, device=DEVICE), qs[0], ks[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("t", [4096, 8192 + 37, 16384, 32768])
def test_triton_matches_reference_on_gpu_at_long_prompts(t):
    # The 35B-A3B attention shapes: 16 query heads, 2 key heads, head dim 256, 8 lookahead queries.
    qs, ks = layers(3, 16, 2, 8, t, 256, torch.bfloat16, seed=t, needles=(t // 5, t // 2))
    ref = token_scores(qs, ks)
    got = token_scores_triton(qs, ks)
    check_close(got, ref, rtol=1e-3, atol=1e-7)
    assert set(ref.topk(2).indices.tolist()) == set(got.topk(2).indices.tolist()) == {t // 5, t // 2}
