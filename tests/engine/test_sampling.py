import math

import pytest
import torch

from engine.sampling import SamplingParams, make_generator, probabilities, sample


def test_greedy_is_argmax_on_fresh_inputs():
    logits = torch.randn(7, 301)
    params = SamplingParams()
    assert torch.equal(sample(logits, params, None), logits.argmax(-1))


def test_top_p_keeps_smallest_prefix_reaching_mass():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]), atol=1e-6)
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert probs[2] > 0 and probs[3] == 0


def test_seeded_sampling_is_reproducible_and_matches_distribution():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0])
    params = SamplingParams(temperature=0.7, seed=1234)
    a = sample(logits.expand(4000, 4), params, make_generator(params, torch.device("cpu")))
    b = sample(logits.expand(4000, 4), params, make_generator(params, torch.device("cpu")))
    assert torch.equal(a, b)
    expected = torch.softmax(logits / 0.7, -1)
    freq = torch.bincount(a, minlength=4).float() / a.numel()
    # four-sigma binomial bound for 4000 draws
    bound = 4 * torch.sqrt(expected * (1 - expected) / a.numel())
    assert torch.all((freq - expected).abs() <= bound), (freq, expected)


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_params_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_temperature_scales_entropy():
    logits = torch.randn(1000)
    cold = probabilities(logits, SamplingParams(temperature=0.2))
    hot = probabilities(logits, SamplingParams(temperature=2.0))
    entropy = lambda p: -(p * torch.log(p.clamp_min(1e-30))).sum().item()
    assert entropy(cold) < entropy(hot) <= math.log(1000) + 1e-4
