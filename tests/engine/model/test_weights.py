"""Loading GGUF variants: fused gate_up experts, an appended MTP block, tied output, bad shapes."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from engine.errors import GGUFError
from engine.gguf.reader import GGUFFile
from engine.gguf.writer import write_gguf
from engine.model.qwen35moe import Qwen35MoE


def rewrite(src, dst, edit):
    """Copy ``src`` to ``dst`` as F32, with ``edit(metadata, tensors)`` applied to the dicts first."""
    with GGUFFile(src) as f:
        md = dict(f.metadata)
        tensors = {n: f.load(n) for n in f.tensors}
    edit(md, tensors)
    specs = [(n, tuple(t.shape), Q.F32, lambda t=t: t.numpy()) for n, t in tensors.items()]
    return write_gguf(dst, md, specs)


def load(path, **kw):
    with GGUFFile(path) as f:
        return Qwen35MoE.from_gguf(f, **kw)


def logits(model, n=20):
    ids = torch.arange(n) * 7 % 101
    return model.forward(ids, model.new_state(n)).logits


def test_fused_gate_up_experts_load_like_separate_ones(gguf_path, engine_model, tmp_path):
    def fuse(md, t):
        for i in range(8):
            gate, up = t.pop(f"blk.{i}.ffn_gate_exps.weight"), t.pop(f"blk.{i}.ffn_up_exps.weight")
            t[f"blk.{i}.ffn_gate_up_exps.weight"] = torch.cat([gate, up], dim=1)

    fused = load(rewrite(gguf_path, tmp_path / "fused.gguf", fuse))
    torch.testing.assert_close(fused.weights.layers[2].moe.experts.up, engine_model.weights.layers[2].moe.experts.up,
                               rtol=0, atol=0)
    torch.testing.assert_close(logits(fused), logits(engine_model), rtol=0, atol=0)


def test_an_appended_mtp_block_is_ignored(gguf_path, engine_model, tmp_path):
    def add_mtp(md, t):
        md["qwen35moe.block_count"] = 9
        md["qwen35moe.nextn_predict_layers"] = 1
        for name in [n for n in t if n.startswith("blk.3.")]:
            t["blk.8." + name[len("blk.3."):]] = torch.randn_like(t[name])  # any use would change the logits
        t["blk.8.nextn.eh_proj.weight"] = torch.zeros(64, 128)

    mtp = load(rewrite(gguf_path, tmp_path / "mtp.gguf", add_mtp))
    assert mtp.cfg.n_layers == 8 and mtp.cfg.n_nextn == 1
    torch.testing.assert_close(logits(mtp), logits(engine_model), rtol=0, atol=0)


def test_without_output_the_embedding_is_tied(gguf_path, tmp_path):
    def drop_output(md, t):
        del t["output.weight"]

    tied = load(rewrite(gguf_path, tmp_path / "tied.gguf", drop_output))
    assert tied.weights.output is tied.weights.embed


def test_a_wrong_shape_names_file_tensor_and_shapes(gguf_path, tmp_path):
    def shrink(md, t):
        t["blk.4.ssm_out.weight"] = t["blk.4.ssm_out.weight"][:, :32]

    path = rewrite(gguf_path, tmp_path / "bad.gguf", shrink)
    with pytest.raises(GGUFError, match=r"bad\.gguf.*blk\.4\.ssm_out\.weight.*\(64, 32\).*\(64, 64\)"):
        load(path)


def test_bf16_weights_keep_vectors_in_float32(gguf_path, engine_model):
    model = load(gguf_path, dtype=torch.bfloat16)
    layer = model.weights.layers[0]
    assert layer.mixer.qkv.dtype == torch.bfloat16 and layer.moe.experts.gate.dtype == torch.bfloat16
    assert layer.attn_norm.dtype == torch.float32 and layer.mixer.a.dtype == torch.float32
    assert layer.moe.router.dtype == torch.float32 and layer.moe.shared.gate_inp.dtype == torch.float32
    ids = torch.arange(20) * 7 % 101
    out = model.forward(ids, model.new_state(20), capture_layers=(0,))
    ref = engine_model.forward(ids, engine_model.new_state(20), capture_layers=(0,))
    assert out.logits.dtype == torch.float32 and out.hidden[0].dtype == torch.bfloat16
    # one layer in bf16 (weights, activations) stays within a few percent of float32;
    # later layers of this random model amplify rounding, so they are compared on the GPU
    h, h_ref = out.hidden[0].float(), ref.hidden[0]
    assert float((h - h_ref).abs().max() / h_ref.abs().max()) < 0.1


def test_projections_fed_the_same_input_share_one_matrix(gguf_path):
    """GDN's qkv, z, beta and alpha, attention's q, k and v, the shared expert's gate and up: one
    matrix each, the parts its row views (no second copy), and the same products."""
    model = load(gguf_path)
    gdn_layer = next(layer.mixer for layer in model.weights.layers if hasattr(layer.mixer, "in_proj"))
    attn = next(layer.mixer for layer in model.weights.layers if hasattr(layer.mixer, "qkv")
                and hasattr(layer.mixer, "q"))
    shared = model.weights.layers[0].moe.shared
    for merged, parts in ((gdn_layer.in_proj, (gdn_layer.qkv, gdn_layer.z, gdn_layer.beta, gdn_layer.alpha)),
                          (attn.qkv, (attn.q, attn.k, attn.v)), (shared.gate_up, (shared.gate, shared.up))):
        assert merged.shape[0] == sum(p.shape[0] for p in parts)
        assert all(p.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr() for p in parts)
        torch.testing.assert_close(torch.cat(parts), merged, rtol=0, atol=0)


def test_merge_rows_keeps_apart_what_cannot_share_a_matrix():
    from engine.kernels.quant import QuantMatrix
    from engine.gguf.quants import quantize
    from engine.model.weights import merge_rows

    a, b = torch.randn(3, 64), torch.randn(5, 64)
    merged, (va, vb) = merge_rows([a, b])
    assert merged.shape == (8, 64) and torch.equal(va, a) and torch.equal(vb, b)
    assert merge_rows([a, b.double()])[0] is None  # dtypes differ
    assert merge_rows([a, torch.randn(5, 32)])[0] is None  # input widths differ

    def q(n, qtype=Q.Q4_0):
        w = torch.randn(n, 64)
        return QuantMatrix.from_gguf_bytes(quantize(w.numpy(), qtype), qtype, n, 64)

    qa, qb = q(3), q(5)
    merged, (va, vb) = merge_rows([qa, qb])
    x = torch.randn(2, 64)
    # the same blocks: equal up to the summation order the CPU's kernels pick for 8 rows against 3 and 5
    assert merged.n == 8
    torch.testing.assert_close(merged.matmul(x), torch.cat([qa.matmul(x), qb.matmul(x)], dim=1), rtol=1e-6, atol=1e-5)
    assert torch.equal(va.matmul(x), qa.matmul(x)) and torch.equal(vb.matmul(x), qb.matmul(x))
    assert merge_rows([qa, q(5, Q.Q8_0)])[0] is None  # quant types differ
    assert merge_rows([qa, b])[0] is None  # one dense, one quantized
    assert merge_rows([qa, qb.with_layout("split")])[0] is None  # layouts differ
    merged, (va, vb) = merge_rows([qa.with_layout("split"), qb.with_layout("split")])
    assert merged.layout == va.layout == vb.layout == "split"
    torch.testing.assert_close(merged.matmul(x), torch.cat([qa.matmul(x), qb.matmul(x)], dim=1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(vb.matmul(x), qb.matmul(x), rtol=1e-6, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_keeps_q4_0_projections_in_the_split_layout(tmp_path):
    """Loaded quantized on CUDA, Q4_0 projections take the split layout; the model's logits
    follow the CPU's (ggml layout, torch reference) within float32 summation-order bounds."""
    from engine.gguf.make_model import make_model
    from engine.gguf.reader import GGUFFile
    from engine.model.qwen35moe import Qwen35MoE

    path = make_model(tmp_path / "q4.gguf", "tiny", quant="q4_0", seed=4)
    with GGUFFile(path) as f:
        gpu = Qwen35MoE.from_gguf(f, device="cuda", dtype=torch.float32, quantized=True)
        cpu = Qwen35MoE.from_gguf(f, device="cpu", dtype=torch.float32, quantized=True)
    from engine.kernels.quant import QuantMatrix

    mats = [m for layer in gpu.weights.layers for m in vars(layer.mixer).values() if isinstance(m, QuantMatrix)]
    assert mats and all(m.layout == ("split" if m.qtype in (Q.Q4_0, Q.Q8_0) else "ggml") for m in mats)
    assert any(m.layout == "split" for m in mats)
    ids = torch.tensor([5, 9, 2, 77, 31])
    a = gpu.forward(ids.cuda(), gpu.new_state(5)).logits.cpu()
    b = cpu.forward(ids, cpu.new_state(5)).logits
    assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4


def test_the_token_embedding_goes_to_host_memory_only_for_an_untied_cuda_load(monkeypatch, gguf_path):
    from engine.model import weights

    monkeypatch.setattr(weights, "EMBED_IN_HOST", True)
    assert weights.embedding_in_host("cuda", tied=False) and weights.embedding_in_host(torch.device("cuda:0"), False)
    assert not weights.embedding_in_host("cuda", tied=True)  # the output head reads all of it every step
    assert not weights.embedding_in_host("cpu", tied=False)
    monkeypatch.setattr(weights, "EMBED_IN_HOST", False)
    assert not weights.embedding_in_host("cuda", tied=False)
    model = load(gguf_path)  # on the CPU the embedding is a plain tensor, whatever the switch says
    assert model.weights.embed.device.type == "cpu" and not model.weights.embed.is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_reads_the_token_embedding_from_host_memory(monkeypatch, gguf_path):
    """The embedding's rows read over the bus give the logits of a device copy bit for bit, eagerly and
    in a captured decode step, and its bytes leave the device's allocations."""
    from engine.model import weights
    from engine.model.decode_graph import DecodeGraph

    def loaded(in_host):
        monkeypatch.setattr(weights, "EMBED_IN_HOST", in_host)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        model = load(gguf_path, device="cuda", dtype=torch.float32)
        return model, torch.cuda.memory_allocated() - before

    host, host_bytes = loaded(True)
    device, device_bytes = loaded(False)
    embed = host.weights.embed
    assert embed.is_cuda and torch.equal(embed, device.weights.embed)
    assert device_bytes - host_bytes >= embed.numel() * embed.element_size()
    ids = torch.arange(24, device="cuda") * 7 % host.cfg.vocab
    outs = []
    for model in (host, device):
        state = model.new_state(32)
        prefill = model.forward(ids[:20], state, logits="all").logits
        step = DecodeGraph(model, state, graph=True)
        outs.append([prefill] + [step.step(ids[i:i + 1]).clone() for i in range(20, 24)])
        assert step.captured
    for a, b in zip(*outs):
        assert torch.equal(a, b)
