"""The training loss of DFlash draft blocks, many blocks of many rows in one draft forward.

The block of an anchor ``a`` is ``[ids[a], MASK x (B - 1)]`` at positions ``a .. a + B - 1``;
it sees the context features strictly before ``a`` and its own block (non-causally), and
slot ``k`` learns the label at ``a + k`` with weight ``exp(-(k - 1) / gamma)``.

Blocks of one row are packed into groups of about ``L / B`` blocks, and every group is one
row of the batched draft forward, with its own copy of the row's context keys: a group's
visibility mask is [g B, L + g B] rather than the [n B, L + n B] of a whole row, so with
hundreds of anchors the attention does about ``2 L`` work per query instead of ``L + n B``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.dflash.draft import DFlashDraft


def default_gamma(block_size: int) -> float:
    """Loss decay: 7 for blocks of 16 and 4 for blocks of 8 (SpecForge), in proportion below."""
    return 7.0 if block_size >= 16 else 4.0 if block_size >= 8 else max(1.0, block_size / 2)


def slot_weights(anchors: torch.Tensor, length: int, block_size: int, gamma: float) -> torch.Tensor:
    """[..., n, B - 1] float32 loss weights of the predicted slots of the blocks at ``anchors`` [..., n]
    in rows of ``length`` tokens (slots past the end weigh 0)."""
    k = torch.arange(1, block_size, device=anchors.device)
    valid = anchors[..., None] + k < length
    return torch.exp(-(k - 1).float() / gamma) * valid


def _groups(n: int, length: int, block_size: int) -> int:
    """How many groups the ``n`` blocks of a row form: the fewest that divides ``n`` and keeps
    a group's queries (``n / groups * B``) near the row's length."""
    least = math.ceil(n / max(1, length // block_size))
    return next(d for d in range(least, n + 1) if n % d == 0)


def usable_anchors(n: int, length: int, block_size: int) -> int:
    """At most ``n`` blocks per row that split into equal groups of about ``length / B`` blocks."""
    groups = math.ceil(n / max(1, length // block_size))
    return n // groups * groups


def rows_per_forward(n: int, length: int, block_size: int, vocab: int, budget: int = 1 << 28) -> int:
    """Rows of ``n`` blocks one draft forward takes while the visibility mask and the logits each
    stay under ``budget`` elements."""
    group = n // _groups(n, length, block_size) * block_size
    per_row = max(n * block_size * (length + group), n * (block_size - 1) * vocab)
    return max(1, budget // per_row)


def block_loss(draft: DFlashDraft, embed: torch.Tensor, output: torch.Tensor, features: torch.Tensor,
               ids: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor,
               gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy of the blocks at ``anchors`` [R, n] (sorted) of ``R`` rows of ``L`` tokens.

    features [R, L, F], ids and labels [R, L]; one row may drop the leading dimension. Returns
    the loss (weighted mean over every slot of every row) and the accepted length under teacher
    forcing [R, n] (drafts that match the label, counted up to the first miss, plus one).
    """
    if ids.dim() == 1:
        loss, accepted = block_loss(draft, embed, output, features[None], ids[None], labels[None], anchors[None],
                                    gamma)
        return loss, accepted[0]
    cfg = draft.cfg
    B = cfg.block_size
    (R, L), n = ids.shape, anchors.shape[1]
    groups = _groups(n, L, B)
    g = n // groups
    device = ids.device
    slot = torch.arange(B, device=device)
    positions = anchors[..., None] + slot  # [R, n, B]
    block = torch.full((R, n, B), cfg.mask_token_id, dtype=torch.long, device=device)
    block[..., 0] = ids.gather(1, anchors)
    ctx_positions = torch.arange(L, device=device)
    sees_context = ctx_positions < anchors.view(R * groups, g, 1, 1)  # [R G, g, 1, L]: strictly before the anchor
    same_block = torch.eye(g, dtype=torch.bool, device=device)[:, None, :, None]  # [g, 1, g, 1]
    visible = torch.cat([sees_context.expand(R * groups, g, B, L).reshape(R * groups, g * B, L),
                         same_block.expand(g, B, g, B).reshape(1, g * B, g * B).expand(R * groups, -1, -1)], dim=-1)
    context = [(k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0))
               for k, v in draft.project_context(features, ctx_positions.expand(R, L))]
    hidden = draft(F.embedding(block.view(R * groups, g * B), embed), positions.view(R * groups, g * B), context,
                   ctx_positions.expand(R * groups, L), visible)
    logits = F.linear(hidden.view(R, n, B, -1)[:, :, 1:], output).float()  # [R, n, B - 1, vocab]
    target_pos = positions[..., 1:]
    target = labels.gather(1, target_pos.clamp(max=L - 1).view(R, -1)).view(R, n, B - 1)
    weight = slot_weights(anchors, L, B, gamma)
    ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1), reduction="none").view(R, n, B - 1)
    loss = (ce * weight).sum() / weight.sum()
    with torch.no_grad():
        hit = (logits.argmax(-1) == target) & (weight > 0)
        accepted = hit.long().cumprod(-1).sum(-1) + 1
    return loss, accepted
