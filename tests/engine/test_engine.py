"""Engine API on a tiny random model: logits, generate, streaming, stops, bad input."""

import pytest
import torch

from engine.engine import Engine
from engine.errors import ConfigError, EngineError
from engine.gguf.make_model import make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine") / "tiny.gguf"
    make_model(path, "tiny", seed=3)
    return path


@pytest.fixture(scope="module")
def eng(tiny):
    return Engine.from_gguf(tiny, device="cpu")


def test_logits_shape_dtype_and_finite(eng):
    ids = eng.tokenizer.encode("def add(a, b):\n    return a + b\n")
    logits = eng.logits(ids)
    assert logits.shape == (len(ids), eng.config.vocab)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_greedy_generate_matches_argmax_of_full_recomputation(eng):
    ids = eng.tokenizer.encode("import os\n")
    g = eng.generate(ids, 12, ignore_eos=True)
    assert len(g.ids) == 12
    seq = list(ids)
    for tok in g.ids:
        assert int(eng.logits(seq)[-1].argmax()) == tok
        seq.append(tok)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_margins_are_top2_gaps_in_ulps(tiny, dtype):
    e = Engine.from_gguf(tiny, device="cpu", dtype=dtype)
    ids = e.tokenizer.encode("for i in range(3):\n")
    new = e.generate(ids, 6, ignore_eos=True).ids
    margins = e.greedy_margins(ids, new)
    assert len(margins) == len(new) and all(m >= 0 for m in margins)
    full = e.logits(list(ids) + list(new[:-1]))[len(ids) - 1:]  # the positions choosing each new token
    top = full.topk(2, dim=-1).values
    ulp = torch.finfo(dtype).eps * 2.0 ** torch.floor(torch.log2(top[:, 0].abs()))
    # a prefix-then-block forward and one whole forward round apart: 1e-4 of a float32 logit, 2 bf16 ulps
    slack = 2.0 if dtype == torch.bfloat16 else 1e-4 / torch.finfo(dtype).eps
    assert margins == pytest.approx(((top[:, 0] - top[:, 1]) / ulp).tolist(), rel=1e-3, abs=slack)
    with pytest.raises(ConfigError, match="continuation"):
        e.greedy_margins(ids, [])


def test_a_long_prompt_prefills_in_chunks_with_the_same_output(eng, monkeypatch):
    """Chunks of 70 tokens over a 200-token prompt (the last one short, the ones after the first continuing
    the cache through the lower-right mask): the same greedy tokens and last-prompt logits as one forward."""
    from engine.model import attention

    ids = [int(t) for t in torch.randint(0, eng.config.vocab, (200,), generator=torch.Generator().manual_seed(7))]
    eng.prefill_chunk = None
    whole = eng.generate(ids, 6, ignore_eos=True)
    assert "prefill_chunks" not in whole.timings.extra
    lower_right = []
    real = attention.continued_causal_attention
    monkeypatch.setattr(attention, "continued_causal_attention", lambda *a: lower_right.append(1) or real(*a))
    try:
        eng.prefill_chunk = 70
        chunked = eng.generate(ids, 6, ignore_eos=True)
        assert chunked.ids == whole.ids and chunked.timings.extra["prefill_chunks"] == 3
        # chunk 2 (70 tokens) in every attention layer; chunk 3 (60) is under the threshold and builds its mask
        assert attention.CONTINUED_CAUSAL_MIN_TOKENS == 64 and len(lower_right) == len(eng.config.attention_layers)
        state = eng.model.new_state(200)
        last = eng._prefill_chunked(torch.tensor(ids), state, {})
        torch.testing.assert_close(last, eng.logits(ids)[-1], rtol=0, atol=1e-4)
        assert state.next_position == 200
        eng.prefill_chunk = 0
        with pytest.raises(ConfigError, match="prefill_chunk must be at least 1"):
            eng.generate(ids, 2)
    finally:
        eng.prefill_chunk = 8192


def test_the_prefill_chunk_setting_reads_its_variable(monkeypatch):
    from engine.engine import PREFILL_CHUNK, prefill_chunk_setting

    monkeypatch.delenv("LUCE_TUNE_PREFILL_CHUNK", raising=False)
    assert prefill_chunk_setting() == PREFILL_CHUNK == 8192
    monkeypatch.setenv("LUCE_TUNE_PREFILL_CHUNK", "4096")
    assert prefill_chunk_setting() == 4096
    monkeypatch.setenv("LUCE_TUNE_PREFILL_CHUNK", "0")
    assert prefill_chunk_setting() is None
    for bad in ("-5", "4k", ""):
        monkeypatch.setenv("LUCE_TUNE_PREFILL_CHUNK", bad)
        with pytest.raises(ConfigError, match="LUCE_TUNE_PREFILL_CHUNK must be a whole number"):
            prefill_chunk_setting()


def test_seeded_sampling_is_reproducible(eng):
    ids = eng.tokenizer.encode("hello")
    a = eng.generate(ids, 10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    b = eng.generate(ids, 10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    assert a.ids == b.ids


def test_streaming_pieces_concatenate_to_text(eng):
    pieces = []
    g = eng.generate(eng.tokenizer.encode("x = 1"), 16, ignore_eos=True,
                     on_token=lambda tok, piece: pieces.append(piece))
    assert len(pieces) == 16
    assert "".join(pieces) == g.text


def test_stop_string_cuts_text(eng):
    ids = eng.tokenizer.encode("a")
    free = eng.generate(ids, 20, ignore_eos=True)
    stop = free.text[3:5]
    if not stop:
        pytest.skip("generated text too short to pick a stop string from")
    g = eng.generate(ids, 20, ignore_eos=True, stop=[stop])
    assert g.stop_reason == "stop"
    assert stop not in g.text
    assert free.text.startswith(g.text)


def test_stop_at_end_of_sequence_drops_the_step_launched_ahead(eng, monkeypatch):
    """Decoding launches each step before it reads the token of the step before: a generation that stops
    at an end-of-sequence token returns the tokens up to it, as many as were streamed, and no more,
    although one step more ran."""
    ids = eng.tokenizer.encode("import os\n")
    free = eng.generate(ids, 12, ignore_eos=True).ids
    at = 5
    monkeypatch.setattr(type(eng.tokenizer), "eos_ids", property(lambda self: [free[at]]))
    first = free.index(free[at])
    streamed = []
    g = eng.generate(ids, 12, on_token=lambda tok, piece: streamed.append(tok))
    assert g.stop_reason == "eos" and g.ids == free[:first + 1] == streamed


def test_token_reader_returns_each_slot_it_was_given():
    from engine.engine import _TokenReader

    reader = _TokenReader(torch.device("cpu"))
    a = reader.put(torch.tensor(7))
    b = reader.put(torch.tensor([9]))
    assert a != b and reader.get(a) == 7 and reader.get(b) == 9
    assert reader.put(torch.tensor(3)) == a and reader.get(a) == 3


def test_blocking_wait_is_a_checked_setting(monkeypatch, eng):
    """``LUCE_TUNE_BLOCKING_WAIT``: off when unset or empty, 0 or 1, anything else refused by name before the
    prefill; on the CPU there is nothing to wait for, so the tokens are the same either way."""
    from engine.engine import BLOCKING_WAIT_ENV, _TokenReader, blocking_wait_setting

    monkeypatch.delenv(BLOCKING_WAIT_ENV, raising=False)
    assert blocking_wait_setting() is False
    ids = eng.tokenizer.encode("import os\n")
    plain = eng.generate(ids, 6, ignore_eos=True).ids
    monkeypatch.setenv(BLOCKING_WAIT_ENV, "1")
    assert blocking_wait_setting() is True and eng.generate(ids, 6, ignore_eos=True).ids == plain
    assert _TokenReader(torch.device("cpu"), blocking=True).blocking is False  # no events on the CPU
    assert torch.device("cpu") not in _TokenReader._warmed  # nor a first blocking wait to make
    monkeypatch.setenv(BLOCKING_WAIT_ENV, " ")
    assert blocking_wait_setting() is False
    prefills = []
    monkeypatch.setattr(eng, "_prefill_chunked", lambda *a, **k: prefills.append(1))
    for bad in ("yes", "2"):
        monkeypatch.setenv(BLOCKING_WAIT_ENV, bad)
        with pytest.raises(ConfigError, match=BLOCKING_WAIT_ENV):
            eng.generate(ids, 2, ignore_eos=True)
    assert prefills == []


def test_stall_trace_prints_the_threads_stacks_while_a_generation_runs(monkeypatch, capfd, eng):
    """``LUCE_TUNE_STALL_TRACE``: off by default; at a short interval a generation prints the Python stacks (this
    test's frame among them) to stderr and the same tokens come out; nothing is printed once it returns; bad values
    are refused by name."""
    import time

    from engine.engine import STALL_TRACE_ENV, stall_trace_setting

    monkeypatch.delenv(STALL_TRACE_ENV, raising=False)
    assert stall_trace_setting() is None
    ids = eng.tokenizer.encode("import os\n")
    plain = eng.generate(ids, 4, ignore_eos=True).ids
    capfd.readouterr()
    monkeypatch.setenv(STALL_TRACE_ENV, "0.01")
    slow = eng.generate(ids, 4, ignore_eos=True, on_token=lambda t, p: time.sleep(0.05))
    err = capfd.readouterr().err
    assert slow.ids == plain
    assert "most recent call first" in err and "test_stall_trace_prints" in err and "generate" in err
    time.sleep(0.1)
    assert capfd.readouterr().err == ""  # cancelled when the generation returned
    for bad in ("soon", "-1", "inf"):
        monkeypatch.setenv(STALL_TRACE_ENV, bad)
        with pytest.raises(ConfigError, match=STALL_TRACE_ENV):
            eng.generate(ids, 2, ignore_eos=True)
    monkeypatch.setenv(STALL_TRACE_ENV, "0")
    assert stall_trace_setting() is None


def test_stall_trace_timer_fires_only_while_no_python_thread_can_run(monkeypatch, capfd, eng):
    """The stacks of a generation past ``LUCE_TUNE_STALL_TRACE`` come from the watchdog while Python threads can
    run (``faulthandler``'s timer, which reads frames with no lock, stays quiet); a call that keeps the
    interpreter's lock past the interval (libc's ``usleep`` through ``ctypes.PyDLL``, which does not release it)
    lets the timer fire, and the tokens come out the same either way."""
    import ctypes
    import time

    from engine.engine import STALL_TRACE_ENV

    hold = ctypes.PyDLL(None).usleep
    ids = eng.tokenizer.encode("def f(x):")
    plain = eng.generate(ids, 3, ignore_eos=True).ids
    capfd.readouterr()
    monkeypatch.setenv(STALL_TRACE_ENV, "0.5")
    free = eng.generate(ids, 3, ignore_eos=True, on_token=lambda t, p: time.sleep(0.3))
    err = capfd.readouterr().err
    assert free.ids == plain
    assert "still running after 0.5 s" in err and "most recent call first" in err
    assert "Timeout (" not in err
    calls = []

    def hold_once(token, piece):
        calls.append(token)
        if len(calls) == 1:
            hold(800_000)

    held = eng.generate(ids, 3, ignore_eos=True, on_token=hold_once)
    err = capfd.readouterr().err
    assert held.ids == plain
    assert "Timeout (0:00:00.500000)!" in err and "test_stall_trace_timer_fires" in err
    time.sleep(0.6)
    assert capfd.readouterr().err == ""  # cancelled when the generation returned


def test_timings_are_measured(eng):
    g = eng.generate(eng.tokenizer.encode("timing"), 8, ignore_eos=True)
    t = g.timings
    assert t.prompt_tokens == len(eng.tokenizer.encode("timing"))
    assert t.new_tokens == 8 and t.prefill_s > 0 and t.decode_s > 0
    assert t.decode_tok_s == pytest.approx(7 / t.decode_s)
    assert t.peak_mem_mb > 0


def test_fed_tokens_are_the_steps_inputs(eng):
    """``feed``: each step decodes the next fed token rather than the sampled one (llama-bench's random tokens):
    the steps route as a teacher-forced forward over the prompt and the fed tokens does, and the ids returned are
    the fed ones."""
    ids = eng.tokenizer.encode("import os\n")
    greedy = eng.generate(ids, 6, ignore_eos=True).ids
    feed = [(t * 7 + 11) % eng.config.vocab for t in greedy]
    assert feed != greedy
    seen = []
    eng.model.set_routing_observer(lambda layer, topk: seen.append((layer, topk.clone())))
    try:
        g = eng.generate(ids, 6, ignore_eos=True, feed=feed)
        decode_routes = [t for layer, t in seen if layer == 0][1:]  # after the prompt's prefill
        seen.clear()
        eng.logits(list(ids) + feed[:5])
        forced = [t for layer, t in seen if layer == 0][0]
    finally:
        eng.model.set_routing_observer(None)
    assert g.ids == feed
    assert len(decode_routes) == 5  # the steps after the first token: feed[0] .. feed[4] decoded
    for j, route in enumerate(decode_routes):
        assert sorted(route.reshape(-1).tolist()) == sorted(forced[len(ids) + j].tolist()), j


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 4, "temperature": -1.0}, "temperature"),
    ({"max_new_tokens": 4, "feed": [1, 2]}, "feed holds 2 tokens"),
    ({"max_new_tokens": 3, "feed": [1, -1, 2, 10**9]}, r"outside the vocabulary of \d+: \[-1\]"),
])
def test_bad_generate_arguments(eng, kwargs, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        eng.generate([1, 2, 3], **kwargs)


def test_out_of_vocab_and_empty_prompts_are_refused(eng):
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        eng.logits([eng.config.vocab])
    with pytest.raises(ConfigError, match="empty"):
        eng.generate([], 4)


def test_unknown_option_is_refused(tiny):
    with pytest.raises(ConfigError, match="unknown engine option"):
        Engine.from_gguf(tiny, device="cpu", expert_budjet_mb=5)


def test_missing_file_is_an_engine_error(tmp_path):
    with pytest.raises(EngineError, match="nope.gguf"):
        Engine.from_gguf(tmp_path / "nope.gguf", device="cpu")
