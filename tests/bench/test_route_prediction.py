"""``bench/route_prediction.py``: the routing predicted at a layer's start against the routing taken, on a tiny
random model; exact where the mixers add nothing; the experts read from the file's blocks as the model's own."""

import pytest
import torch

from bench.route_prediction import BlockExperts, cold_hits, measure
from engine.gguf.reader import GGUFFile
from engine.hybrid import routing_predictor
from engine.model.qwen35moe import Qwen35MoE
from engine.model.weights import raw_experts


def test_cold_hits_counts_the_first_cold_names():
    cold = torch.tensor([True, False, True, True, False, True])
    predicted = torch.tensor([[1, 0, 2, 3], [4, 5, 3, 1]])  # cold in order: 0, 2, 3 | 5, 3
    actual = torch.tensor([[2, 1, 4, 5], [3, 5, 0, 1]])
    assert cold_hits(predicted, actual, cold, 1) == (1, 2)  # 0 misses, 5 hits
    assert cold_hits(predicted, actual, cold, 2) == (3, 4)  # 0, 2 | 5, 3
    assert cold_hits(predicted, actual, cold, 4) == (3, 5)  # three names in the first row, two in the second


def test_prediction_is_exact_where_the_mixers_add_nothing(tmp_path):
    from engine.gguf.make_model import make_model

    path = make_model(tmp_path / "tiny.gguf", "tiny", n_expert=16, quant="q8_0", seed=3)
    gguf = GGUFFile(path)
    plain = Qwen35MoE.from_gguf(gguf, device="cpu", dtype=torch.float32)
    model = Qwen35MoE.from_gguf(gguf, device="cpu", dtype=torch.float32, expert_device="meta")
    model.set_expert_executor(BlockExperts(raw_experts(gguf, model.cfg)))
    ids = torch.randint(0, model.cfg.vocab, (24,), generator=torch.Generator().manual_seed(1))
    ref = plain.forward(ids, plain.new_state(24)).logits
    torch.testing.assert_close(model.forward(ids, model.new_state(24)).logits, ref, rtol=1e-4, atol=1e-4)
    predictors = [routing_predictor(layer.moe.router, layer.attn_norm, layer.post_norm, device="cpu")
                  for layer in model.weights.layers]
    table = measure(model, predictors, ids, 0.5)
    o = table["overall"]
    assert 0 < o["overlap"] <= 1 and all(h is None or 0 <= h <= 1 for h in o["hit"])
    assert len(table["layers"]) == model.cfg.n_layers
    for layer in model.weights.layers:  # the mixers' output projections zeroed: h + mixed == h
        (layer.mixer.o if hasattr(layer.mixer, "o") else layer.mixer.out).zero_()
    exact = measure(model, predictors, ids, 0.5)["overall"]
    assert exact["overlap"] == 1.0 and all(h == 1.0 for h in exact["hit"] if h is not None)


def test_predictions_some_layers_ahead_come_from_that_layers_input(tmp_path):
    """``ahead_predictors(by=N)``: None for the first N layers, then layer i's router under the norms of layer i - N's
    mixer input; ``measure`` then predicts every layer (the first N at their own start), and a prediction from
    further back names no more of the routed experts on this model than one from nearer."""
    from engine.gguf.make_model import make_model
    from engine.hybrid import ahead_predictors

    path = make_model(tmp_path / "tiny.gguf", "tiny", n_expert=16, quant="q8_0", seed=4)
    gguf = GGUFFile(path)
    model = Qwen35MoE.from_gguf(gguf, device="cpu", dtype=torch.float32, expert_device="meta")
    model.set_expert_executor(BlockExperts(raw_experts(gguf, model.cfg)))
    norms = [(layer.moe.router, layer.attn_norm, layer.post_norm) for layer in model.weights.layers]
    n = len(norms)
    for by in (1, 2):
        ahead = ahead_predictors(norms, device="cpu", by=by)
        assert len(ahead) == n and all(p is None for p in ahead[:by])
        for i in range(by, n):
            router, _, post = norms[i]
            assert torch.equal(ahead[i], routing_predictor(router, norms[i - by][1], post, device="cpu"))
    with pytest.raises(ValueError, match="at least a layer"):
        ahead_predictors(norms, device="cpu", by=0)
    predictors = [routing_predictor(*layer, device="cpu") for layer in norms]
    ids = torch.randint(0, model.cfg.vocab, (48,), generator=torch.Generator().manual_seed(2))
    tables = [measure(model, predictors, ids, 0.5, ahead=ahead_predictors(norms, device="cpu", by=by) if by else None)
              for by in (0, 1, 2)]
    assert all(len(t["layers"]) == n for t in tables)
    overlaps = [t["overall"]["overlap"] for t in tables]
    assert 0 < overlaps[2] <= overlaps[1] <= overlaps[0] <= 1


def test_previous_counts_the_token_befores_experts(tmp_path):
    """``previous``: with the mixers' outputs zeroed a token's routing depends on its id alone, so a row of one id
    routes as the token before it in every layer (1.0), and a single token has no token before it (None)."""
    from engine.gguf.make_model import make_model

    path = make_model(tmp_path / "tiny.gguf", "tiny", n_expert=16, quant="q8_0", seed=6)
    gguf = GGUFFile(path)
    model = Qwen35MoE.from_gguf(gguf, device="cpu", dtype=torch.float32, expert_device="meta")
    model.set_expert_executor(BlockExperts(raw_experts(gguf, model.cfg)))
    predictors = [routing_predictor(layer.moe.router, layer.attn_norm, layer.post_norm, device="cpu")
                  for layer in model.weights.layers]
    mixed = measure(model, predictors, torch.randint(0, model.cfg.vocab, (16,),
                                                     generator=torch.Generator().manual_seed(2)), 0.5)
    assert 0 <= mixed["overall"]["previous"] <= 1 and all(0 <= r["previous"] <= 1 for r in mixed["layers"])
    for layer in model.weights.layers:
        (layer.mixer.o if hasattr(layer.mixer, "o") else layer.mixer.out).zero_()
    same = measure(model, predictors, torch.full((6,), 11), 0.5)
    assert same["overall"]["previous"] == 1.0 and all(r["previous"] == 1.0 for r in same["layers"])
    one = measure(model, predictors, torch.tensor([11]), 0.5)
    assert one["overall"]["previous"] is None and all(r["previous"] is None for r in one["layers"])
