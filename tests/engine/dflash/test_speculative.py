"""The speculative loop: identical greedy output, lossless sampling, stops, fallback, stalls."""

import pytest
import torch

from engine.dflash.device_loop import LAG
from engine.dflash.speculative import speculative_generate
from engine.errors import ConfigError, GenerationStalled
from engine.sampling import SamplingParams, probabilities

OTHER_prompt = [11, 2000, 7, 7, 301]


@pytest.mark.parametrize("rollback", ["capture", "recompute"])
@pytest.mark.parametrize("spec_len", [2, 5, 8])
def test_random_draft_greedy_matches_plain(target, random_draft, prompt, plain, spec_len, rollback):
    for ids in (prompt, OTHER_prompt):
        ref = plain(target, ids, 20)
        new, stats = speculative_generate(target, random_draft, ids, 20, spec_len=spec_len, rollback=rollback,
                                          fallback_threshold=0)
        assert new == ref
        assert stats.new_tokens == 20 and stats.verify_steps >= 1 and not stats.fallback


@pytest.mark.parametrize("rollback", ["capture", "recompute"])
@pytest.mark.parametrize("spec_len", [2, 4, 8])
def test_right_draft_accepts_blocks_and_matches_plain(target, right_draft, prompt, plain, spec_len, rollback):
    # 64 tokens: the first 48 are what the draft was trained on (whole blocks accepted), the
    # rest are new to it (partial acceptances and rollbacks)
    ref = plain(target, prompt, 64)
    new, stats = speculative_generate(target, right_draft, prompt, 64, spec_len=spec_len, rollback=rollback,
                                      fallback_threshold=0)
    assert new == ref
    assert stats.acceptance_length > 1.3
    assert max(stats.accept_lengths) == spec_len  # some block accepted whole, bonus token included
    assert stats.rollbacks > 0
    # the first token comes from the prefill; a last single token, if any, from a plain step
    assert sum(stats.accept_lengths) == stats.spec_tokens == 63 - stats.plain_steps
    assert stats.accepted == stats.spec_tokens - stats.verify_steps


@pytest.mark.parametrize("spec_len, restore", [(3, "auto"), (8, "auto"), (3, "replay")])
def test_static_verify_step_matches_plain(target, right_draft, prompt, plain, spec_len, restore):
    """Full verify blocks through the fixed-shape decode step and its own rollback (the path a
    CUDA graph replays), the shorter last block eagerly: the same greedy output, partial
    acceptances included. ``auto`` restores the shipped target's states from those written after
    each token; ``replay`` replays the kept tokens."""
    ref = plain(target, prompt, 61)
    new, stats = speculative_generate(target, right_draft, prompt, 61, spec_len=spec_len, fallback_threshold=0,
                                      verify_path="static", restore=restore)
    assert new == ref
    assert stats.verify_path == "static" and stats.draft_path == "static" and stats.verify_path_note is None
    assert stats.restore == ("states" if restore == "auto" else restore)
    assert stats.rollbacks > 0 and max(stats.accept_lengths) == spec_len
    # whole blocks to the end, the last token's too (no one-token step to build inside the decode loop); only what
    # was kept is counted
    assert stats.plain_steps == 0 and 1 + stats.spec_tokens == 61
    assert stats.accepted == stats.spec_tokens - stats.verify_steps
    eager, eager_stats = speculative_generate(target, right_draft, prompt, 61, spec_len=spec_len,
                                              fallback_threshold=0)
    # the fixed-shape draft proposed the same blocks; eager verification takes a last single token by a plain step
    assert stats.accept_lengths == eager_stats.accept_lengths + [1] * eager_stats.plain_steps
    assert eager_stats.verify_path == eager_stats.draft_path == "eager" and eager_stats.restore is None


@pytest.mark.parametrize("lag", [0, 2])
def test_the_device_loop_runs_at_any_lag(target, right_draft, prompt, plain, lag):
    """The host launching 0 or 2 steps past the one it waits for: plain decoding's output to the exact length, the
    tokens of the steps in flight at the end dropped; a lag past ``MAX_LAG`` is one clear error."""
    from engine.dflash.device_loop import MAX_LAG

    for n in (33, 50):
        new, stats = speculative_generate(target, right_draft, prompt, n, spec_len=4, fallback_threshold=0,
                                          verify_path="static", lag=lag)
        assert new == plain(target, prompt, n) and stats.device_loop
        assert stats.plain_steps == 0 and 1 + stats.spec_tokens == n  # the last token from a step too
    with pytest.raises(ConfigError, match="lag must be"):
        speculative_generate(target, right_draft, prompt, 4, spec_len=4, verify_path="static", lag=MAX_LAG + 1)


@pytest.mark.parametrize("restore", ["states", "replay"])
def test_the_host_loop_restores_either_way(target, right_draft, prompt, plain, restore):
    """The host loop (``device_loop=False``) rolls its fixed-shape verify back through the restore asked for, with
    plain decoding's output; an unknown restore is one clear error."""
    new, stats = speculative_generate(target, right_draft, prompt, 40, spec_len=4, fallback_threshold=0,
                                      verify_path="static", device_loop=False, restore=restore)
    assert new == plain(target, prompt, 40)
    assert not stats.device_loop and stats.restore == restore and stats.rollbacks > 0
    with pytest.raises(ConfigError, match="restore must be one of"):
        speculative_generate(target, right_draft, prompt, 4, spec_len=4, verify_path="static", restore="copy")


def test_graph_verify_falls_back_where_it_cannot_capture(target, random_draft, prompt, plain):
    """On the CPU nothing can be captured: the static step runs, and the statistics say why."""
    new, stats = speculative_generate(target, random_draft, prompt, 12, spec_len=4, fallback_threshold=0,
                                      verify_path="graph")
    assert new == plain(target, prompt, 12)
    assert stats.verify_path == "static" and "not on a CUDA device" in stats.verify_path_note
    with pytest.raises(ConfigError, match="verify_path must be one of"):
        speculative_generate(target, random_draft, prompt, 4, spec_len=4, verify_path="fast")


def test_max_new_tokens_is_exact_when_spec_len_does_not_divide_it(target, right_draft, prompt, plain):
    for n in (1, 2, 7, 13):
        new, stats = speculative_generate(target, right_draft, prompt, n, spec_len=8, fallback_threshold=0)
        assert new == plain(target, prompt, n)
        assert stats.new_tokens == n


def test_eos_and_stop_predicate_end_the_generation(target, right_draft, prompt, plain):
    ref = plain(target, prompt, 30)
    new, stats = speculative_generate(target, right_draft, prompt, 30, spec_len=8, eos_ids={ref[10]},
                                      fallback_threshold=0)
    assert new == ref[:ref.index(ref[10]) + 1] and stats.stop_reason == "eos"
    seen = []
    new, stats = speculative_generate(target, right_draft, prompt, 30, spec_len=8, fallback_threshold=0,
                                      stop=lambda ids: seen.append(len(ids)) or len(ids) == 13)
    assert new == ref[:13] and stats.stop_reason == "stop"
    assert seen == list(range(1, 14))  # called once per committed token, in order


def test_low_acceptance_falls_back_to_plain_decoding(target, random_draft, prompt, plain):
    ref = plain(target, prompt, 30)
    new, stats = speculative_generate(target, random_draft, prompt, 30, spec_len=4, fallback_threshold=1.5,
                                      fallback_window=4)
    assert new == ref
    assert stats.fallback and stats.verify_steps == 4 and stats.fallback_at == 1 + sum(stats.accept_lengths)
    assert stats.plain_steps == 30 - stats.fallback_at
    d = stats.as_dict()
    assert d["fallback"] is True and d["acceptance_length"] == pytest.approx(stats.acceptance_length)


def test_good_acceptance_does_not_fall_back(target, right_draft, prompt, plain):
    _, stats = speculative_generate(target, right_draft, prompt, 40, spec_len=8, fallback_threshold=1.5,
                                    fallback_window=2)
    assert not stats.fallback and stats.plain_steps == 0


def test_stalled_generation_raises(target, random_draft, prompt, plain):
    with pytest.raises(GenerationStalled, match=r"no progress for .* s \(limit 1e-09 s\) at token 1"):
        speculative_generate(target, random_draft, prompt, 10, spec_len=4, fallback_threshold=0,
                             stall_timeout_s=1e-9)


@pytest.mark.parametrize("spec_len", [1, 9])
def test_spec_len_outside_the_block_is_refused(target, random_draft, prompt, plain, spec_len):
    with pytest.raises(ConfigError, match="spec_len must be between 2 and the draft's block size 8"):
        speculative_generate(target, random_draft, prompt, 4, spec_len=spec_len)


def test_timings_are_measured(target, right_draft, prompt, plain):
    _, stats = speculative_generate(target, right_draft, prompt, 24, spec_len=8, fallback_threshold=0)
    assert stats.prefill_s > 0 and stats.draft_s > 0 and stats.verify_s > 0
    assert stats.draft_s + stats.verify_s + stats.rollback_s <= stats.decode_s


class _TooMany(Exception):
    pass


def _exact_first_tokens(model, prompt, k, params, max_leaves):
    """P(first k new tokens) under the target's sampling distribution, by enumerating the tree."""
    out = {}

    def walk(prefix, p):
        if len(prefix) == len(prompt) + k:
            out[tuple(prefix[len(prompt):])] = p
            if len(out) > max_leaves:
                raise _TooMany
            return
        with torch.inference_mode():
            logits = model.forward(torch.tensor(prefix), model.new_state(len(prefix)), logits="last").logits[-1]
        probs = probabilities(logits, params)
        for tok in torch.nonzero(probs).flatten().tolist():
            walk(prefix + [tok], p * float(probs[tok]))

    try:
        walk(list(prompt), 1.0)
    except _TooMany:
        return None
    return out


def test_sampling_is_lossless(target, right_draft, prompt, plain):
    # k = 5 tokens at spec_len 5: the prefill samples one, a verify step commits 1 to 4 more.
    # The temperature is the highest (of a few) whose tree of possible outputs stays small
    # enough to enumerate yet spreads over at least 6 sequences expected 5 times or more.
    k, n_samples, top_p = 5, 300, 0.8
    for temperature in (0.4, 0.3, 0.25, 0.2, 0.15, 0.1):
        params = SamplingParams(temperature=temperature, top_p=top_p)
        exact = _exact_first_tokens(target, prompt, k, params, max_leaves=400)
        if exact is not None and sum(p * n_samples >= 5 for p in exact.values()) >= 6:
            break
    else:
        pytest.fail("no temperature gives an enumerable yet spread output distribution on this target")
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5)
    counts: dict[tuple, int] = {}
    accepted = 0
    for seed in range(n_samples):
        new, stats = speculative_generate(target, right_draft, prompt, k, spec_len=k, temperature=temperature,
                                          top_p=top_p, seed=seed, fallback_threshold=0)
        counts[tuple(new)] = counts.get(tuple(new), 0) + 1
        accepted += stats.accepted
    assert set(counts) <= set(exact)  # never a sequence the target cannot produce
    assert accepted >= n_samples // 2  # drafts were accepted: the acceptance path is what is tested

    # chi-square goodness of fit; sequences expected fewer than 5 times share one bin
    big = [s for s, p in exact.items() if p * n_samples >= 5]
    bins = [(exact[s] * n_samples, counts.get(s, 0)) for s in big]
    rest = (n_samples - sum(e for e, _ in bins), n_samples - sum(o for _, o in bins))
    if rest[0] >= 1:
        bins.append(rest)
    expected = torch.tensor([e for e, _ in bins], dtype=torch.float64)
    observed = torch.tensor([o for _, o in bins], dtype=torch.float64)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    dof = len(bins) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                            torch.tensor(chi2 / 2, dtype=torch.float64)))
    tv = 0.5 * float((observed - expected).abs().sum()) / n_samples  # over the bins
    assert dof >= 2
    assert p_value > 1e-3, f"chi2 {chi2:.1f} on {dof} dof (p = {p_value:.2e}), total variation {tv:.3f}"
    assert tv < 0.15


def test_verification_runs_through_the_hybrid_expert_executor(target_path, target, right_draft, prompt, plain):
    from engine.gguf.reader import GGUFFile
    from engine.hybrid import attach_hybrid
    from engine.model.qwen35moe import Qwen35MoE

    with GGUFFile(target_path) as f:
        model = Qwen35MoE.from_gguf(f, device="cpu")
    total_mb = sum(t.numel() * t.element_size() for layer in model.weights.layers
                   for t in (layer.moe.experts.gate, layer.moe.experts.up, layer.moe.experts.down)) / 2**20
    hybrid = attach_hybrid(model, 0.5 * total_mb, threads=1)
    try:
        ref = plain(target, prompt, 40)
        new, stats = speculative_generate(model, right_draft, prompt, 40, spec_len=8, fallback_threshold=0)
        assert new == ref and stats.acceptance_length > 1.3
        snap = hybrid.stats_snapshot()
        assert snap.hot_hits > 0 and snap.cold_hits > 0
    finally:
        hybrid.close()


def test_stop_predicate_sees_the_eos_token_too(target, right_draft, prompt, plain):
    ref = plain(target, prompt, 12)
    seen = []
    new, stats = speculative_generate(target, right_draft, prompt, 12, spec_len=8, eos_ids={ref[5]},
                                      fallback_threshold=0, stop=lambda ids: seen.append(ids[-1]) and False)
    assert new == ref[:ref.index(ref[5]) + 1] == seen and stats.stop_reason == "eos"


@pytest.mark.parametrize("verify_path", ["eager", "static"])
def test_speculation_is_tried_again_after_a_plain_stretch(target, random_draft, prompt, plain, verify_path):
    """A fallback decodes ``reprobe_after`` tokens plainly, then speculates again; each further
    fallback doubles the stretch. Greedy output stays the plain one, and every token is counted
    once: the prefill's, the verify steps', the plain steps'. The static path runs the device loop,
    whose tries each run the ``LAG`` steps in flight when the host judges them too."""
    ref = plain(target, prompt, 60)
    new, stats = speculative_generate(target, random_draft, prompt, 60, spec_len=4, fallback_threshold=1.5,
                                      fallback_window=2, reprobe_after=3, verify_path=verify_path)
    lag = LAG if verify_path == "static" else 0
    assert stats.device_loop == (verify_path == "static")
    assert new == ref
    assert stats.fallbacks >= 3 and stats.fallback and stats.fallback_at == 1 + sum(stats.accept_lengths[:2])
    assert 0 <= stats.verify_steps - (2 + lag) * stats.fallbacks <= 1 + lag
    assert 1 + stats.spec_tokens + stats.plain_steps == 60
    assert stats.plain_path == ("static" if verify_path == "static" else "eager")
    wide, wide_stats = speculative_generate(target, random_draft, prompt, 60, spec_len=4, fallback_threshold=1.5,
                                            fallback_window=6, reprobe_after=3, verify_path=verify_path)
    # the first try is judged after 6 verify steps, every later one after REPROBE_WINDOW = 2
    assert wide == ref and wide_stats.fallbacks >= 2
    assert 0 <= wide_stats.verify_steps - (6 + lag) - (2 + lag) * (wide_stats.fallbacks - 1) <= 1 + lag
    once, once_stats = speculative_generate(target, random_draft, prompt, 60, spec_len=4, fallback_threshold=1.5,
                                            fallback_window=2, reprobe_after=0, verify_path=verify_path)
    assert once == ref and once_stats.fallbacks == 1 and once_stats.verify_steps == 2 + lag


@pytest.mark.parametrize("verify_path", ["eager", "static"])
def test_plain_stretches_keep_the_draft_context(target, right_draft, prompt, plain, verify_path):
    """After plain stretches the draft cache holds the context rows of every token the target
    ran, at their positions: the rows a single eager extension over the whole sequence gives."""
    from engine.dflash.draft import DraftCache
    from engine.dflash.speculative import SpecOptions, _Generation
    from engine.dflash.train_rows import target_pass

    opts = SpecOptions(spec_len=4, fallback_threshold=100.0, fallback_window=1, reprobe_after=3,
                       verify_path=verify_path)
    run = _Generation(target, right_draft, list(prompt), 40, opts, SamplingParams(), set(), None)
    new, stats = run.run()
    assert new == plain(target, prompt, 40) and stats.fallbacks >= 3
    seq = torch.tensor(list(prompt) + new[:-1])  # the last token was never run
    assert run.cache.length + sum(r.shape[0] for r in run.pending) == seq.shape[0]
    features, _ = target_pass(target, seq, right_draft.cfg.target_layer_ids, "target")
    ref = DraftCache.empty(right_draft, seq.shape[0])
    ref.extend(right_draft, features, torch.arange(seq.shape[0]))
    n = run.cache.length
    assert torch.equal(run.cache.positions[:n], ref.positions[:n])
    for a, b in zip(run.cache.k + run.cache.v, ref.k + ref.v):
        torch.testing.assert_close(a[:, :n], b[:, :n], atol=1e-4, rtol=1e-4)


def test_dflash_slower_compares_token_rates():
    from engine.dflash.speculative import dflash_slower

    # 4 steps of 1 ms committing 1 token each: 1,000 tok/s against plain steps of 0.4 ms (2,500 tok/s)
    assert dflash_slower([1, 1, 1, 1], [1e-3] * 4, [4e-4, 5e-4, 3e-4])
    # 5 tokens per 1 ms step: 5,000 tok/s, faster than plain
    assert not dflash_slower([5, 5], [1e-3, 1e-3], [4e-4])
    assert dflash_slower([2, 2], [1e-3, 1e-3], [4e-4, 4e-4, 9e-3])  # the median plain step: 0.4 ms


@pytest.mark.parametrize("slower", [True, False])
def test_auto_fallback_opens_with_timed_plain_steps_and_judges_by_rate(target, random_draft, prompt, plain,
                                                                     monkeypatch, slower):
    """``fallback_threshold="auto"``: CALIBRATION_STEPS plain steps first, then each window of verify
    steps is judged by ``dflash_slower`` on their wall times against the plain steps'."""
    from engine.dflash import speculative as sp

    seen = []

    def judge(accepts, step_s, plain_s):
        seen.append((list(accepts), list(step_s), list(plain_s)))
        return slower

    monkeypatch.setattr(sp, "dflash_slower", judge)
    ref = plain(target, prompt, 40)
    new, stats = speculative_generate(target, random_draft, prompt, 40, spec_len=4, fallback_threshold="auto",
                                      fallback_window=3, reprobe_after=4)
    assert new == ref
    accepts, step_s, plain_s = seen[0]
    assert len(accepts) == len(step_s) == 3 and len(plain_s) == sp.CALIBRATION_STEPS
    assert all(t > 0 for t in step_s + plain_s) and stats.step_ms > 0 and stats.plain_step_ms > 0
    assert accepts == stats.accept_lengths[:3]
    assert stats.fallback == slower and (stats.fallbacks >= 2 if slower else stats.fallbacks == 0)
    assert stats.plain_steps >= sp.CALIBRATION_STEPS


def test_auto_fallback_is_validated(target, random_draft, prompt):
    with pytest.raises(ConfigError, match="fallback_threshold must be >= 0 or 'auto', got 'sometimes'"):
        speculative_generate(target, random_draft, prompt, 4, spec_len=4, fallback_threshold="sometimes")
