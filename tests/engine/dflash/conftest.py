"""A tiny random qwen35moe target, a random draft written through gguf_io, and a "right" draft:
one trained (with the real training loss) until it reproduces the target's greedy continuation
of PROMPT, so that verification accepts whole blocks."""

import pytest
import torch

from engine.dflash.block_loss import block_loss
from engine.dflash.draft import DFlashDraft, DraftConfig
from engine.dflash.gguf_io import load_draft, write_draft_gguf
from engine.dflash.train import new_draft_config
from engine.dflash.train_rows import target_pass
from engine.gguf.make_model import make_model
from engine.gguf.reader import GGUFFile
from engine.model.qwen35moe import Qwen35MoE

PROMPT = [5, 17, 99, 3, 250, 1000, 42]
CONTINUATION = 48


def plain_greedy(model: Qwen35MoE, ids: list[int], n: int) -> list[int]:
    """Plain one-token-at-a-time greedy decoding: the reference speculative decoding must match."""
    with torch.inference_mode():
        state = model.new_state(len(ids) + n)
        out = model.forward(torch.tensor(ids), state, logits="last")
        token = out.logits[-1].argmax()
        new = [int(token)]
        while len(new) < n:
            token = model.forward(token.reshape(1), state, logits="last").logits[-1].argmax()
            new.append(int(token))
    return new


# float32 on the CPU: a verify runs its block in one call, plain decoding token by token, so their sums round in
# different orders (and differently by CPU: an AVX2-only host's kernels differed by 2.2e-5 on keys of magnitude 3.7).
# The absolute tolerance is relative to the largest value of the tensor compared; a wrong rollback differs by O(1).
ATOL, RTOL = 2e-5, 1e-4


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL * max(1.0, expected.abs().max().item()))


def plain_decoded_state(model: Qwen35MoE, ids: list[int], max_len: int):
    """The state after plain decoding of ``ids`` one token at a time."""
    state = model.new_state(max_len)
    with torch.inference_mode():
        for t in ids:
            model.forward(torch.tensor([t]), state, logits="none")
    return state


def states_equal(a, b) -> None:
    """Assert two states hold the same lengths, KV caches, conv and recurrent states (to float32 rounding)."""
    assert (a.seq_len, a.next_position) == (b.seq_len, b.next_position)
    for i, cache in a.kv.items():
        other = b.kv[i]
        assert cache.length == other.length
        close(cache.k[:, :cache.length], other.k[:, :other.length])
        close(cache.v[:, :cache.length], other.v[:, :other.length])
    for i in a.conv:
        close(a.conv[i], b.conv[i])
        close(a.recurrent[i], b.recurrent[i])


@pytest.fixture(scope="session")
def plain_state():
    return plain_decoded_state


@pytest.fixture(scope="session")
def assert_states_equal():
    return states_equal


@pytest.fixture(scope="session")
def prompt():
    return list(PROMPT)


@pytest.fixture(scope="session")
def plain():
    return plain_greedy


@pytest.fixture(scope="session")
def target_path(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("dflash") / "target.gguf", "tiny", seed=3)


@pytest.fixture(scope="session")
def target(target_path):
    with GGUFFile(target_path) as f:
        return Qwen35MoE.from_gguf(f, device="cpu")


def random_draft_config(target: Qwen35MoE, **overrides) -> DraftConfig:
    kw = dict(n_layers=2, hidden=target.cfg.hidden, ffn=96, n_head=4, n_head_kv=2, head_dim=16, rms_eps=1e-6,
              rope_theta=1e7, block_size=8, mask_token_id=target.cfg.vocab - 1, target_layer_ids=(0, 2),
              vocab=target.cfg.vocab)
    return DraftConfig(**(kw | overrides))


@pytest.fixture(scope="session")
def random_draft_path(target, tmp_path_factory):
    draft = DFlashDraft(random_draft_config(target)).init_random(torch.Generator().manual_seed(0))
    return write_draft_gguf(draft, tmp_path_factory.mktemp("dflash") / "random-draft.gguf", qtype="f32")


@pytest.fixture(scope="session")
def random_draft(random_draft_path):
    return load_draft(random_draft_path)


@pytest.fixture(scope="session")
def right_draft(target):
    """A draft trained on the target's greedy continuation of PROMPT until it predicts it."""
    seq = torch.tensor(PROMPT + plain_greedy(target, PROMPT, CONTINUATION))
    cfg = new_draft_config(target.cfg, n_layers=1, block_size=8, layer_ids=(1, 3))
    draft = DFlashDraft(cfg).init_random(torch.Generator().manual_seed(0))
    features, labels = (t.clone() for t in target_pass(target, seq, cfg.target_layer_ids, "target"))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        anchors = (torch.randperm(len(seq) - 2, generator=gen)[:32] + 1).sort().values
        loss, _ = block_loss(draft, target.weights.embed, target.weights.output, features, seq, labels, anchors, 4.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return draft.requires_grad_(False)
