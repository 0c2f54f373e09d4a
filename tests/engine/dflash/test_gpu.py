"""DFlash on CUDA: the Gated DeltaNet kernels in the verify and in the capture rollback's replay,
greedy identity in float32 (eager verify blocks and blocks replayed from a CUDA graph), and a
bf16 run end to end."""

import pytest
import torch

from engine.dflash.block_loss import block_loss
from engine.dflash.distill import DistillOptions, distill
from engine.dflash.draft import DFlashDraft
from engine.dflash.rollback import make_rollback
from engine.dflash.speculative import speculative_generate
from engine.dflash.train import new_draft_config
from engine.dflash.train_rows import DistilledRows, target_pass, target_passes
from engine.gguf.reader import GGUFFile
from engine.model.qwen35moe import Qwen35MoE
from engine.train.batches import TokenStream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _load(path, dtype):
    with GGUFFile(path) as f:
        return Qwen35MoE.from_gguf(f, device="cuda", dtype=dtype)


@pytest.fixture(scope="module")
def cuda_target(target_path):
    return _load(target_path, torch.float32)


def _right_draft(model, prompt, plain, dtype=torch.float32):
    seq = torch.tensor(prompt + plain(model, prompt, 48), device="cuda")
    cfg = new_draft_config(model.cfg, n_layers=1, block_size=8, layer_ids=(1, 3))
    draft = DFlashDraft(cfg, device="cuda", dtype=torch.float32).init_random(torch.Generator().manual_seed(0))
    features, labels = (t.clone().float() if t.is_floating_point() else t.clone()
                        for t in target_pass(model, seq, cfg.target_layer_ids, "target"))
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    embed, output = model.weights.embed.float(), model.weights.output.float()
    for _ in range(80):
        anchors = (torch.randperm(len(seq) - 2, generator=gen)[:32] + 1).sort().values.cuda()
        loss, _ = block_loss(draft, embed, output, features, seq, labels, anchors, 4.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return draft.to(dtype).requires_grad_(False)


def _plain_cuda(model, ids, n):
    with torch.inference_mode():
        state = model.new_state(len(ids) + n)
        token = model.forward(torch.tensor(ids, device="cuda"), state, logits="last").logits[-1].argmax()
        new = [int(token)]
        while len(new) < n:
            token = model.forward(token.reshape(1), state, logits="last").logits[-1].argmax()
            new.append(int(token))
    return new


def test_verify_uses_fla(cuda_target):
    pytest.importorskip("fla")
    assert cuda_target.delta_rule.backend == "fla"


@pytest.mark.parametrize("rollback", ["capture", "recompute"])
def test_float32_greedy_matches_plain_on_cuda(cuda_target, prompt, rollback):
    draft = _right_draft(cuda_target, prompt, _plain_cuda)
    ref = _plain_cuda(cuda_target, prompt, 64)
    for spec_len in (4, 8):
        new, stats = speculative_generate(cuda_target, draft, prompt, 64, spec_len=spec_len, rollback=rollback,
                                          fallback_threshold=0)
        assert new == ref
        assert stats.acceptance_length > 1.3 and stats.rollbacks > 0
        assert stats.verify_s > 0 and stats.draft_s > 0  # CUDA event timings


@pytest.mark.parametrize("mode", ["capture", "recompute"])
@pytest.mark.parametrize("n, keep", [(8, 3), (8, 6), (16, 11)])
def test_rollback_on_cuda_equals_plain(cuda_target, prompt, mode, n, keep):
    good = _plain_cuda(cuda_target, prompt, n)
    block = good[:keep] + [(t + 1) % cuda_target.cfg.vocab for t in good[keep:]]
    max_len = len(prompt) + n + 2
    with torch.inference_mode():
        state = cuda_target.new_state(max_len)
        cuda_target.forward(torch.tensor(prompt, device="cuda"), state, logits="none")
        rb = make_rollback(mode, cuda_target, state)
        rb.verify(torch.tensor(block, device="cuda"), (1, 3))
        rb.rollback(keep)
        ref = cuda_target.new_state(max_len)
        for t in prompt + block[:keep]:
            cuda_target.forward(torch.tensor([t], device="cuda"), ref, logits="none")
    assert (state.seq_len, state.next_position) == (ref.seq_len, ref.next_position)
    # fla's chunked kernels (the verify, the replay) and its token-by-token kernel (the reference)
    # round differently: Triton's float32 dots run in TF32 (2^-11 relative per product), and the
    # fused-MoE kernel's too, so keys a few layers deep differ by ~1.6e-3 (measured on the H200,
    # recompute mode, layer 3). A wrong state (a head, a token or a layer out of place) is off
    # by O(1) in this norm-wise measure.
    for i in state.conv:
        assert _rel(state.conv[i], ref.conv[i]) < 1e-3, f"conv state of layer {i}: {_rel(state.conv[i], ref.conv[i]):.2e}"
        assert _rel(state.recurrent[i], ref.recurrent[i]) < 1e-2, \
            f"recurrent state of layer {i}: {_rel(state.recurrent[i], ref.recurrent[i]):.2e}"
    for i, c in state.kv.items():
        assert c.length == ref.kv[i].length
        k, k_ref = c.k[:, :c.length], ref.kv[i].k[:, :c.length]
        assert _rel(k, k_ref) < 1e-2, f"keys of layer {i}: {_rel(k, k_ref):.2e}"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative difference of ``a`` from ``b``."""
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def test_bf16_end_to_end(target_path, prompt):
    model = _load(target_path, torch.bfloat16)
    draft = _right_draft(model, prompt, _plain_cuda, dtype=torch.bfloat16)
    ref = _plain_cuda(model, prompt, 48)
    new, stats = speculative_generate(model, draft, prompt, 48, spec_len=8, fallback_threshold=0)
    assert len(new) == 48 and stats.acceptance_length > 1.3, f"acceptance {stats.acceptance_length:.2f}"
    # bf16 verify (one chunk) and plain decode (token by token) round differently; near-ties may
    # flip, so only the start is held to identity
    assert new[:8] == ref[:8], f"speculative {new[:8]} against plain {ref[:8]}"


def test_distilled_rows_in_bf16_on_cuda(target_path, tmp_path):
    """transformers' module continues prompts in bf16 on CUDA; the engine's bf16 target agrees with
    almost every generated token, and a batched step over the rows trains under autocast."""
    pytest.importorskip("transformers")
    model = _load(target_path, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    stream = TokenStream.from_documents([torch.randint(0, 2000, (500,), generator=gen).tolist()])
    sequences = distill(target_path, stream, DistillOptions(16, 24, 40, batch=8), device="cuda",
                        cache=tmp_path / "d.distill.pt")
    assert sequences.shape == (16, 64)
    cfg = new_draft_config(model.cfg, n_layers=1, block_size=8, layer_ids=(1, 3))
    rows = DistilledRows(model, sequences, 24, cfg.target_layer_ids, "target", batch=16, seed=0)
    batch = rows.batch(0)
    assert rows.passes == 16 and rows.agreement > 0.9, rows.agreement
    draft = DFlashDraft(cfg, device="cuda", dtype=torch.float32).init_random(torch.Generator().manual_seed(0))
    anchors = (torch.rand(16, 39, generator=gen).argsort(-1)[:, :32] + 24).sort(-1).values.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, accepted = block_loss(draft, model.weights.embed, model.weights.output, batch.features, batch.ids,
                                    batch.labels, anchors, 4.0)
    loss.backward()
    assert torch.isfinite(loss) and accepted.shape == (16, 32)
    assert all(torch.isfinite(p.grad).all() for p in draft.parameters())


def test_graph_verify_matches_plain_on_cuda(cuda_target, prompt):
    """Full blocks' proposals and verification replayed from CUDA graphs, with the verify step's own
    rollback, float32."""
    draft = _right_draft(cuda_target, prompt, _plain_cuda)
    ref = _plain_cuda(cuda_target, prompt, 64)
    for spec_len in (4, 8):
        new, stats = speculative_generate(cuda_target, draft, prompt, 64, spec_len=spec_len, fallback_threshold=0,
                                          verify_path="graph")
        assert stats.verify_path == stats.draft_path == "cuda_graph", stats.verify_path_note
        assert stats.device_loop  # greedy, graph verify: the steps follow one another on the device
        assert new == ref
        assert stats.acceptance_length > 1.3 and stats.rollbacks > 0
    host, host_stats = speculative_generate(cuda_target, draft, prompt, 64, spec_len=8, fallback_threshold=0,
                                            verify_path="graph", device_loop=False)
    assert host == ref and not host_stats.device_loop and host_stats.verify_path == "cuda_graph"


def test_graph_lookup_matches_plain_on_cuda(cuda_target, prompt):
    """The committed-text lookup inside the captured device loop (its history written by the advance launch, its
    block merged into the draft launch) and on the host loop: plain greedy output, float32, on a prompt that
    repeats itself so that the lookup finds matches from the first block."""
    draft = _right_draft(cuda_target, prompt, _plain_cuda)
    ids = prompt + prompt[:5] + prompt
    ref = _plain_cuda(cuda_target, ids, 64)
    for spec_len in (4, 8):
        new, stats = speculative_generate(cuda_target, draft, ids, 64, spec_len=spec_len, fallback_threshold=0,
                                          verify_path="graph", lookup=2)
        assert stats.verify_path == stats.draft_path == "cuda_graph", stats.verify_path_note
        assert stats.device_loop and stats.lookup == 2 and new == ref
    host, host_stats = speculative_generate(cuda_target, draft, ids, 64, spec_len=8, fallback_threshold=0,
                                            verify_path="graph", device_loop=False, lookup=2)
    assert host == ref and not host_stats.device_loop


def test_graph_plain_stretches_match_plain_on_cuda(cuda_target, prompt):
    """Fallbacks and re-tries on CUDA: the plain stretches replay the captured one-token step, the
    verify blocks theirs, and greedy output stays the plain one, float32."""
    draft = _right_draft(cuda_target, prompt, _plain_cuda)
    ref = _plain_cuda(cuda_target, prompt, 64)
    new, stats = speculative_generate(cuda_target, draft, prompt, 64, spec_len=4, fallback_threshold=100.0,
                                      fallback_window=1, reprobe_after=3, verify_path="graph")
    assert new == ref
    assert stats.plain_path == stats.verify_path == stats.draft_path == "cuda_graph"
    assert stats.fallbacks >= 3 and 1 + stats.spec_tokens + stats.plain_steps == 64


def test_training_passes_take_the_fused_experts_on_cuda(cuda_target, prompt):
    """train-draft's target passes run the fused-MoE executor on CUDA: the same features (float32)
    and labels as the reference executor's loop over experts."""
    from engine.dflash.train import pass_executor
    from engine.model.moe import FusedExpertExecutor

    fused = pass_executor(cuda_target)
    assert isinstance(fused, FusedExpertExecutor) and fused.impl == "triton"
    seq = torch.tensor(prompt + list(range(50, 90)), device="cuda")
    ref_features, ref_labels = target_pass(cuda_target, seq, (1, 3), "target")
    saved, cuda_target.executor = cuda_target.executor, fused
    try:
        features, labels = target_pass(cuda_target, seq, (1, 3), "target")
    finally:
        cuda_target.executor = saved
    assert torch.equal(labels, ref_labels)
    assert float((features - ref_features).abs().max() / ref_features.abs().max()) < 1e-4


def test_batched_training_passes_equal_one_forward_per_row_on_cuda(cuda_target):
    """train-draft's rows go through the target together (fla's chunk kernel with the rows as extra
    heads, one attention call, the fused experts over every token): float32 features within fla's
    chunk precision of one forward per row, and the same labels but for near ties."""
    from engine.dflash.train import pass_executor

    saved, cuda_target.executor = cuda_target.executor, pass_executor(cuda_target)
    try:
        ids = torch.randint(0, cuda_target.cfg.vocab, (6, 160), device="cuda", generator=torch.Generator("cuda")
                            .manual_seed(1))
        features, labels = target_passes(cuda_target, ids, (1, 3), "target")
        for r in range(6):
            ref_features, ref_labels = target_pass(cuda_target, ids[r], (1, 3), "target")
            assert float((labels[r] == ref_labels).float().mean()) >= 0.99
            assert float((features[r] - ref_features).abs().max() / ref_features.abs().max()) < 1e-3
    finally:
        cuda_target.executor = saved
