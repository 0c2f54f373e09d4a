"""Compressed prefill on tiny random models: identity at keep ratio 1, the threshold, the
kept tokens at their original (or renumbered) positions, and the target's expert executor."""

import pytest
import torch

from engine.errors import ConfigError
from engine.gguf.reader import GGUFFile
from engine.model.qwen35moe import Qwen35MoE
from engine.pflash import Drafter, PFlashConfig, compressed_prefill, pflash_select
from engine.pflash.select import n_kept_chunks
from engine.tokenizer import Tokenizer

# Small chunks so that a prompt the CPU prefills in a second has a few dozen of them.
CONFIG = PFlashConfig(threshold=64, chunk=8, n_lookahead=4, pool_kernel=5, head_chunks=1, tail_chunks=2)
T = 203  # 26 chunks, the last one 3 tokens long


@pytest.fixture(scope="module")
def models(pflash_models):
    target_path, drafter_path = pflash_models
    with GGUFFile(target_path) as f:
        target = Qwen35MoE.from_gguf(f, device="cpu")
    drafter = Drafter.from_gguf(drafter_path, target_vocab=Tokenizer.from_gguf(target_path), device="cpu")
    return target, drafter


@pytest.fixture(scope="module")
def prompt(models):
    return torch.randint(0, models[0].cfg.vocab, (T,), generator=torch.Generator().manual_seed(11))


def plain_prefill(target, ids, positions=None, reserve=4):
    state = target.new_state(ids.shape[0] + reserve)
    out = target.forward(ids, state, positions=positions, logits="last")
    return state, out.logits[-1]


def greedy_continue(target, state, logits, n):
    """n greedy tokens after a prefill, decoding with default positions."""
    tokens = [int(logits.argmax())]
    for _ in range(n - 1):
        out = target.forward(torch.tensor(tokens[-1:]), state, logits="last")
        tokens.append(int(out.logits[-1].argmax()))
    return tokens


def test_keep_ratio_one_is_identical_to_no_compression(models, prompt):
    target, drafter = models
    res = compressed_prefill(target, prompt, drafter=drafter, keep_ratio=1.0, config=CONFIG, reserve=4)
    assert res.selection.drafter_s > 0  # the drafter did run: the prompt is over the threshold
    assert res.selection.kept == T and torch.equal(res.kept_positions, torch.arange(T))
    state, logits = plain_prefill(target, prompt)
    assert torch.equal(res.logits, logits)
    assert greedy_continue(target, res.state, res.logits, 4) == greedy_continue(target, state, logits, 4)


def test_prompt_under_the_threshold_is_kept_whole_without_the_drafter(models, prompt):
    target, drafter = models
    short = prompt[:CONFIG.threshold]
    sel = pflash_select(drafter, short, 0.1, CONFIG)
    assert sel.drafter_s == 0.0 and sel.kept == sel.total == CONFIG.threshold
    assert torch.equal(sel.kept_ids, short)
    res = compressed_prefill(target, short, drafter=drafter, keep_ratio=0.1, config=CONFIG)
    assert torch.equal(res.logits, plain_prefill(target, short)[1])


def test_compressed_prefill_keeps_chunks_at_their_original_positions(models, prompt):
    target, drafter = models
    res = compressed_prefill(target, prompt, drafter=drafter, keep_ratio=0.3, config=CONFIG, reserve=4)
    pos = res.kept_positions
    n_chunks = -(-T // CONFIG.chunk)
    chunks = torch.unique(pos // CONFIG.chunk)
    assert chunks.numel() == n_kept_chunks(n_chunks, 0.3) == 8
    assert torch.all(pos[1:] > pos[:-1])
    assert {0, n_chunks - 2, n_chunks - 1} <= set(chunks.tolist())
    assert pos[-1] == T - 1 and res.selection.kept == pos.numel() == 8 * CONFIG.chunk - 5
    assert torch.equal(res.selection.kept_index, pos) and torch.equal(res.selection.kept_ids, prompt[pos])
    assert res.state.seq_len == pos.numel() and res.state.next_position == T

    # The same tokens prefilled by hand at the same positions, then one decode step at position T.
    state, logits = plain_prefill(target, prompt[pos], positions=pos)
    assert torch.equal(res.logits, logits)
    assert greedy_continue(target, res.state, res.logits, 3) == greedy_continue(target, state, logits, 3)
    t = res.timings()
    assert t["pflash_total_tokens"] == T and t["pflash_kept_tokens"] == pos.numel()
    assert t["pflash_drafter_s"] > 0 and t["pflash_target_prefill_s"] > 0


def test_renumbered_positions_run_from_zero(models, prompt):
    target, drafter = models
    config = PFlashConfig(**{**CONFIG.__dict__, "renumber": True})
    res = compressed_prefill(target, prompt, drafter=drafter, keep_ratio=0.2, config=config)
    n = res.selection.kept
    assert torch.equal(res.kept_positions, torch.arange(n)) and res.state.next_position == n
    assert res.selection.kept_index[-1] == T - 1
    assert torch.equal(res.selection.kept_ids, prompt[res.selection.kept_index])
    assert torch.equal(res.logits, plain_prefill(target, res.selection.kept_ids)[1])


def test_target_experts_run_through_its_executor_on_kept_tokens_only(models, prompt):
    target, drafter = models
    default = target.executor
    seen = []

    def recording(layer, x, topk_ids, topk_w):
        seen.append((layer, x.shape[0]))
        return default(layer, x, topk_ids, topk_w)

    target.set_expert_executor(recording)
    try:
        res = compressed_prefill(target, prompt, drafter=drafter, keep_ratio=0.1, config=CONFIG)
    finally:
        target.set_expert_executor(default)
    assert seen == [(layer, res.selection.kept) for layer in range(target.cfg.n_layers)]


def test_captured_layers_cover_the_kept_tokens(models, prompt):
    target, drafter = models
    res = compressed_prefill(target, prompt, drafter=drafter, keep_ratio=0.2, config=CONFIG, capture_layers=(1, 2))
    assert sorted(res.output.hidden) == [1, 2]
    assert res.output.hidden[1].shape == (res.selection.kept, target.cfg.hidden)


@pytest.mark.parametrize("kwargs, message", [({"keep_ratio": 0.0}, "keep ratio"),
                                             ({"keep_ratio": 0.5, "reserve": -1}, "reserve")])
def test_bad_arguments_are_config_errors(models, prompt, kwargs, message):
    target, drafter = models
    with pytest.raises(ConfigError, match=message):
        compressed_prefill(target, prompt, drafter=drafter, config=CONFIG, **kwargs)


@pytest.fixture(scope="module")
def cuda_models(pflash_models):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    target_path, drafter_path = pflash_models
    with GGUFFile(target_path) as f:
        target = Qwen35MoE.from_gguf(f, device="cuda")
    drafter = Drafter.from_gguf(drafter_path, target_vocab=Tokenizer.from_gguf(target_path), device="cuda")
    return target, drafter


@pytest.mark.gpu
def test_triton_and_torch_scorers_agree_on_the_drafter(cuda_models, prompt):
    from engine.pflash.score import token_scores
    from engine.pflash.score_triton import token_scores_triton

    _, drafter = cuda_models
    queries, keys = drafter.lookahead(prompt.cuda(), CONFIG.n_lookahead)
    ref, got = token_scores(queries, keys), token_scores_triton(queries, keys)
    err = (got - ref).abs()
    assert (err - 1e-3 * ref).max() <= 1e-6, (err.max().item(), (err / ref).max().item())


@pytest.mark.gpu
def test_compressed_prefill_on_gpu_matches_a_plain_prefill_of_the_kept_tokens(cuda_models, prompt):
    target, drafter = cuda_models
    ids = prompt.cuda()
    full = compressed_prefill(target, ids, drafter=drafter, keep_ratio=1.0, config=CONFIG, reserve=4)
    _, logits = plain_prefill(target, ids)
    # bf16 on CUDA, and expert outputs are summed with atomics: equal up to rounding
    assert (full.logits - logits).abs().max() <= 2e-2 * logits.abs().max()
    res = compressed_prefill(target, ids, drafter=drafter, keep_ratio=0.3, config=CONFIG, reserve=4)
    pos = res.kept_positions
    assert pos[-1] == T - 1 and res.state.next_position == T
    _, logits = plain_prefill(target, ids[pos], positions=pos)
    assert (res.logits - logits).abs().max() <= 2e-2 * logits.abs().max()
