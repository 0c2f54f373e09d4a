"""The committed-text lookup (``engine.dflash.lookup``): its block against a plain Python reference, and
speculative decoding with it, on the host loop and the device loop."""

import random

import pytest
import torch

from engine.dflash.device_loop import SpecLoop, room_steps
from engine.dflash.draft import DraftCache
from engine.dflash.lookup import check_min_match, lookup_block, merge_lookup
from engine.dflash.speculative import speculative_generate
from engine.errors import ConfigError


def reference(ids: list[int], min_match: int, n: int) -> list[int] | None:
    """The latest j < len - 1 whose ``min_match`` ids ending at j equal the last ones; what follows, periodic."""
    length = len(ids)
    for j in range(length - 2, min_match - 2, -1):
        if ids[j - min_match + 1:j + 1] == ids[length - min_match:]:
            period = length - 1 - j
            return [ids[j + 1 + i % period] for i in range(n)]
    return None


@pytest.mark.parametrize("min_match", [1, 2, 3, 5])
def test_lookup_block_is_the_reference_on_random_text(min_match):
    rng = random.Random(min_match)
    found_some = missed_some = False
    for case in range(300):
        vocab = rng.choice([3, 5, 40])  # small vocabularies repeat, large ones mostly do not
        length = rng.randint(1, 37)
        ids = [rng.randrange(vocab) for _ in range(length)]
        if case % 3 == 0 and length > 4:  # a loop of some period at the end
            period = rng.randint(1, length // 2)
            ids = ids[:length - period] + ids[length - 2 * period:length - period]
        n = rng.randint(1, 11)
        # the buffer runs past the committed ids with junk that must be ignored
        history = torch.tensor(ids + [rng.randrange(vocab) for _ in range(rng.randint(0, 9))])
        found, tokens = lookup_block(history, length, min_match, n)
        want = reference(ids, min_match, n)
        assert bool(found) == (want is not None), (ids, min_match)
        if want is not None:
            assert tokens.tolist() == want, (ids, min_match, n)
            found_some = True
        else:
            missed_some = True
    assert found_some and missed_some


def test_a_loop_shorter_than_the_block_repeats_its_period():
    history = torch.tensor([9, 1, 2, 3, 1, 2, 3, 1, 2, 0, 0])
    found, tokens = lookup_block(history, torch.tensor(9), 2, 7)  # ends with 1, 2: period 3
    assert bool(found) and tokens.tolist() == [3, 1, 2, 3, 1, 2, 3]
    drafted = torch.tensor([7, 7, 7])
    assert merge_lookup(drafted, history, 9, 2).tolist() == [3, 1, 2]
    assert merge_lookup(drafted, torch.tensor([4, 5, 6, 7]), 4, 2).tolist() == [7, 7, 7]  # no match: the draft's
    with pytest.raises(ValueError, match="min_match"):
        lookup_block(history, 9, 0, 3)
    check_min_match(0)
    with pytest.raises(ValueError, match="match length"):
        check_min_match(17)


def test_lookup_keeps_greedy_output_on_both_loops(target, right_draft, random_draft, prompt, plain):
    """A prompt that repeats itself, so that the lookup finds matches from the first block: plain greedy decoding's
    output on the host loop (eager verify) and on the device loop (fixed-shape verify), at two spec_lens."""
    ids = prompt + prompt[:5] + prompt
    ref = plain(target, ids, 40)
    for draft in (right_draft, random_draft):
        for spec_len in (3, 8):
            for path in ("eager", "static"):
                new, stats = speculative_generate(target, draft, ids, 40, spec_len=spec_len, fallback_threshold=0,
                                                  verify_path=path, lookup=2)
                assert new == ref, (spec_len, path)
                assert stats.lookup == 2 and stats.device_loop == (path == "static")
    with pytest.raises(ConfigError, match="match length"):
        speculative_generate(target, random_draft, ids, 4, spec_len=4, lookup=-1)


def test_the_device_loop_proposes_the_lookups_block_and_keeps_its_history(target, random_draft, prompt):
    """The history the host loads ends with ids that occurred before: the loop's first verify block carries the
    lookup's copy, later ones the lookup's block wherever the reference finds a match; after the steps the
    history is the loaded ids and every committed one."""
    spec_len, steps = 4, 5
    total = len(prompt) + steps * spec_len + room_steps() * spec_len
    state, cache = target.new_state(total), DraftCache.empty(random_draft, total)
    layer_ids = tuple(random_draft.cfg.target_layer_ids)
    loop = SpecLoop(target, state, random_draft, cache, target.weights.embed, target.weights.output,
                    tokens=spec_len, layer_ids=layer_ids, graph=False, lookup=3)
    with torch.inference_mode():
        out = target.forward(torch.tensor(prompt), state, capture_layers=layer_ids, logits="last")
        cache.extend(random_draft, torch.cat([out.hidden[i] for i in layer_ids], dim=-1), torch.arange(len(prompt)))
        token = out.logits[-1].argmax()
    t = int(token)
    history = [1, 2, t, 11, 12, 13, 1, 2, t]  # the end (1, 2, t) occurred at the start: period 6
    with pytest.raises(ValueError, match="needs the committed ids"):
        loop.load(token, steps * spec_len)
    loop.load(token, steps * spec_len, torch.tensor(history))
    proposals = []
    for _ in range(steps):
        want = reference(history, 3, spec_len - 1)
        row = loop.result(loop.launch())
        proposals.append((want, loop.verify.ids[1:].tolist()))
        history += row[1:1 + row[0]]
    assert proposals[0] == ([11, 12, 13], [11, 12, 13])
    assert all(want == got for want, got in proposals if want is not None)
    assert loop.history[:int(loop.hist_len)].tolist() == history
