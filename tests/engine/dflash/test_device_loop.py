"""The device loop (``engine.dflash.device_loop``): the state restore with ``keep`` a device value, steps that
advance their own counters, and the state they leave behind."""

import pytest
import torch

from engine.dflash.device_loop import SpecLoop, room_steps
from engine.dflash.draft import DraftCache
from engine.errors import ConfigError
from engine.model.decode_graph import DecodeGraph


@pytest.mark.parametrize("restore", ["states", "replay"])
@pytest.mark.parametrize("tokens", [2, 5])
def test_restore_at_a_device_keep_is_the_host_restore(target, prompt, tokens, restore):
    """For every kept length, ``restore_at(tensor(keep))`` gives the recurrent and conv states of ``rollback(keep)``
    bit for bit; at keep == T it gives the step's own states back (the very bits with the per-token states)."""
    block = torch.tensor([7, 300, 12, 99, 1024][:tokens])
    for keep in range(1, tokens + 1):
        states = []
        for how in ("host", "device"):
            state = target.new_state(len(prompt) + tokens)
            with torch.inference_mode():
                target.forward(torch.tensor(prompt), state, logits="none")
                step = DecodeGraph(target, state, tokens=tokens, graph=False, rollback=True, restore=restore)
                step.step(block)
                after = [t.clone() for t in (*state.conv.values(), *state.recurrent.values())]
                if how == "host":
                    step.rollback(keep)
                else:
                    step.restore_at(torch.tensor(keep))
            states.append([t.clone() for t in (*state.conv.values(), *state.recurrent.values())])
        for a, b in zip(*states):
            assert torch.equal(a, b), keep
        if keep == tokens:
            for a, b in zip(states[1], after):
                if restore == "states":
                    assert torch.equal(a, b)
                else:
                    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def run_loop(target, draft, prompt, steps, spec_len, restore="auto"):
    """``steps`` device-loop steps after a prefill, every report read; the loop, the state and the reports."""
    total = len(prompt) + steps * spec_len + room_steps() * spec_len
    state = target.new_state(total)
    cache = DraftCache.empty(draft, total)
    layer_ids = tuple(draft.cfg.target_layer_ids)
    loop = SpecLoop(target, state, draft, cache, target.weights.embed, target.weights.output, tokens=spec_len,
                    layer_ids=layer_ids, graph=False, restore=restore)
    with torch.inference_mode():
        out = target.forward(torch.tensor(prompt), state, capture_layers=layer_ids, logits="last")
        features = torch.cat([out.hidden[i] for i in layer_ids], dim=-1)
        cache.extend(draft, features, torch.arange(len(prompt)))
        token = out.logits[-1].argmax()
    loop.load(token, steps * spec_len)
    reports = [loop.result(loop.launch()) for _ in range(steps)]
    return loop, state, cache, int(token), reports


@pytest.mark.parametrize("spec_len, restore", [(3, "states"), (8, "states"), (3, "replay")])
def test_steps_commit_plain_greedy_tokens_and_store_the_state(target, right_draft, prompt, plain, plain_state,
                                                             assert_states_equal, spec_len, restore):
    """Each step's report holds ``keep`` and the target's choices; the tokens committed are plain greedy decoding's,
    and after ``store`` the state (lengths, KV caches, conv and recurrent states) is plain decoding's over every
    token run, the last committed one excepted (it opens the next block)."""
    # past the 48 tokens the draft was trained on: whole blocks first, then partial acceptances
    loop, state, cache, first, reports = run_loop(target, right_draft, prompt, 64 // spec_len + 2, spec_len, restore)
    assert loop.verify.restore == restore
    committed = [first]
    for row in reports:
        keep = row[0]
        assert 1 <= keep <= spec_len
        committed += row[1:1 + keep]
    assert committed == plain(target, prompt, len(committed))
    assert any(row[0] < spec_len for row in reports) and any(row[0] > 1 for row in reports)
    token = loop.store()
    assert int(token) == committed[-1]
    run = len(prompt) + len(committed) - 1
    assert state.seq_len == state.next_position == run and cache.length == run
    assert_states_equal(state, plain_state(target, prompt + committed[:-1], state.max_len))


def test_load_refuses_a_state_without_room(target, random_draft, prompt):
    state = target.new_state(len(prompt) + 8)
    cache = DraftCache.empty(random_draft, len(prompt) + 64)
    loop = SpecLoop(target, state, random_draft, cache, target.weights.embed, target.weights.output, tokens=4,
                    layer_ids=tuple(random_draft.cfg.target_layer_ids), graph=False)
    with torch.inference_mode():
        target.forward(torch.tensor(prompt), state, logits="none")
    with pytest.raises(ConfigError, match="needs room for"):
        loop.load(torch.tensor(3), 8)


def test_the_room_and_the_slots_follow_the_lag(target, random_draft, prompt):
    """A loop of lag 3 keeps 5 report slots and asks for 5 blocks of room past the tokens wanted: a state sized for
    the default lag's room is refused; a lag past ``MAX_LAG`` is refused where the loop is built."""
    from engine.dflash.device_loop import MAX_LAG

    total = len(prompt) + 8 + room_steps() * 4
    state, cache = target.new_state(total), DraftCache.empty(random_draft, total + 64)
    layers = tuple(random_draft.cfg.target_layer_ids)
    with torch.inference_mode():
        target.forward(torch.tensor(prompt), state, logits="none")
    cache.length = len(prompt)
    loop = SpecLoop(target, state, random_draft, cache, target.weights.embed, target.weights.output, tokens=4,
                    layer_ids=layers, graph=False, lag=3)
    assert loop._slots.shape[0] == room_steps(3) == 5
    with pytest.raises(ConfigError, match="needs room for 28 more tokens"):
        loop.load(torch.tensor(3), 8)
    SpecLoop(target, state, random_draft, cache, target.weights.embed, target.weights.output, tokens=4,
             layer_ids=layers, graph=False, lag=1).load(torch.tensor(3), 8)
    with pytest.raises(ValueError, match="lag must be 0..4"):
        SpecLoop(target, state, random_draft, cache, target.weights.embed, target.weights.output, tokens=4,
                 layer_ids=layers, graph=False, lag=MAX_LAG + 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("restore", ["states", "replay"])
def test_cuda_restore_at_is_the_host_restore_in_a_graph(target_path, prompt, restore):
    """On CUDA (the Triton delta rule), ``restore_at`` captured once in a CUDA graph and replayed for each ``keep``
    gives the states of the host's ``rollback(keep)``, bit for bit."""
    from engine.gguf.reader import GGUFFile
    from engine.model.decode_graph import capture_graph
    from engine.model.qwen35moe import Qwen35MoE

    with GGUFFile(target_path) as f:
        model = Qwen35MoE.from_gguf(f, device="cuda", dtype=torch.float32)
    block = torch.tensor([7, 300, 12, 99, 1024], device="cuda")
    keep_t = torch.ones((), dtype=torch.long, device="cuda")
    for keep in range(1, 6):
        states = []
        for how in ("host", "graph"):
            state = model.new_state(len(prompt) + 5)
            with torch.inference_mode():
                model.forward(torch.tensor(prompt, device="cuda"), state, logits="none")
                step = DecodeGraph(model, state, tokens=5, graph=True, rollback=True, restore=restore)
                step.step(block)
                if how == "host":
                    step.rollback(keep)
                else:
                    saved = [t.clone() for t in (*state.conv.values(), *state.recurrent.values())]
                    graph = capture_graph(lambda: step.restore_at(keep_t), model.device)
                    for t, copy in zip((*state.conv.values(), *state.recurrent.values()), saved):
                        t.copy_(copy)  # the capture's warm-up restored already
                    keep_t.fill_(keep)
                    graph.replay()
            torch.cuda.synchronize()
            states.append([t.clone() for t in (*state.conv.values(), *state.recurrent.values())])
        for a, b in zip(*states):
            assert torch.equal(a, b), keep
