"""GDN value-head order: GGUF tiles (value head p reads key head p % k_heads), HF groups
(p reads p // r); the converter tiles, the loader groups, and the two are inverse."""

import pytest
import torch

from engine.model.config import ModelConfig
from engine.model.value_heads import is_value_head_tensor, reorder_value_heads, to_grouped, to_tiled

K_HEADS, V_HEADS, HEAD_V = 2, 6, 3
R = V_HEADS // K_HEADS


def cfg() -> ModelConfig:
    return ModelConfig(n_layers=4, hidden=8, vocab=10, n_head=2, n_head_kv=1, head_dim=4, rms_eps=1e-6,
                       rope_theta=1e4, rope_dim=2, n_expert=2, n_expert_used=1, expert_ffn=4, shared_ffn=4,
                       conv_kernel=4, gdn_k_heads=K_HEADS, gdn_v_heads=V_HEADS, gdn_head_k=5, gdn_head_v=HEAD_V,
                       full_attention_interval=4)


def test_tiled_order_puts_key_head_p_mod_k_at_value_head_p():
    # grouped: head p (= key head p // r, copy p % r) holds the label 10 * key head + copy
    grouped = torch.tensor([10 * (p // R) + p % R for p in range(V_HEADS)], dtype=torch.float32)
    tiled = to_tiled(grouped, 0, K_HEADS, V_HEADS, 1)
    assert [int(x) // 10 for x in tiled] == [p % K_HEADS for p in range(V_HEADS)]
    assert tiled.tolist() == [0, 10, 1, 11, 2, 12]
    torch.testing.assert_close(to_grouped(tiled, 0, K_HEADS, V_HEADS, 1), grouped)


@pytest.mark.parametrize("name, shape", [
    ("blk.0.attn_qkv.weight", (2 * 2 * 5 + V_HEADS * HEAD_V, 8)),
    ("blk.0.ssm_conv1d.weight", (2 * 2 * 5 + V_HEADS * HEAD_V, 4)),
    ("blk.0.attn_gate.weight", (V_HEADS * HEAD_V, 8)),
    ("blk.0.ssm_alpha.weight", (V_HEADS, 8)),
    ("blk.0.ssm_beta.weight", (V_HEADS, 8)),
    ("blk.0.ssm_a", (V_HEADS,)),
    ("blk.0.ssm_dt.bias", (V_HEADS,)),
    ("blk.0.ssm_out.weight", (8, V_HEADS * HEAD_V)),
])
def test_round_trip_and_what_moves(name, shape):
    assert is_value_head_tensor(name)
    x = torch.randn(shape)
    tiled = reorder_value_heads(name, x, cfg(), to="tiled")
    assert not torch.equal(tiled, x)
    torch.testing.assert_close(reorder_value_heads(name, tiled, cfg(), to="grouped"), x, rtol=0, atol=0)
    if name.endswith(("attn_qkv.weight", "ssm_conv1d.weight")):
        torch.testing.assert_close(tiled[:20], x[:20], rtol=0, atol=0)  # q and k channels stay


def test_value_head_rows_move_whole():
    x = torch.arange(V_HEADS * HEAD_V, dtype=torch.float32)[:, None].expand(-1, 8)
    tiled = reorder_value_heads("blk.0.attn_gate.weight", x, cfg(), to="tiled")
    heads = tiled[:, 0].reshape(V_HEADS, HEAD_V)
    for p in range(V_HEADS):
        src = (p % K_HEADS) * R + p // K_HEADS  # grouped index of tiled head p
        assert heads[p].tolist() == list(range(src * HEAD_V, (src + 1) * HEAD_V))


def test_other_tensors_and_equal_head_counts_are_untouched():
    x = torch.randn(V_HEADS * HEAD_V, 8)
    assert not is_value_head_tensor("blk.0.ssm_norm.weight")
    assert reorder_value_heads("blk.0.ffn_up_shexp.weight", x, cfg(), to="tiled") is x
    equal = ModelConfig(**{**cfg().__dict__, "gdn_v_heads": K_HEADS})
    assert reorder_value_heads("blk.0.attn_gate.weight", x, equal, to="tiled") is x
    with pytest.raises(ValueError):
        reorder_value_heads("blk.0.attn_gate.weight", x, cfg(), to="sideways")
