"""Training a DFlash draft for a qwen35moe target (the SpecForge recipe).

The target is frozen and runs through the engine's own model: one forward per training
sequence gives the context features (residual stream at ``target_layer_ids``) and the
labels. Each step draws random anchors in every row and trains the draft on their blocks
(``engine.dflash.block_loss``): all blocks of all rows of a step go through the draft
together, in as few forwards as the memory budget of one allows.

Rows are corpus windows by default. With ``distill`` they are the target's own greedy
continuations of corpus prompts (``engine.dflash.distill``), anchors lie in the generated
part, and each sequence's target pass runs once (``engine.dflash.train_rows``): at inference
the draft must predict what the target generates, which corpus text only approximates.

Labels are the target's own greedy choices at each position by default (what verification
will compare against); ``labels="corpus"`` uses the row's tokens instead. Batches and
anchors depend only on (seed, step), so a resumed run sees what an uninterrupted one would.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from engine.dflash.block_loss import block_loss, default_gamma, rows_per_forward, slot_weights, usable_anchors
from engine.dflash.compat import check_compatible
from engine.dflash.distill import DistillOptions, cache_path, distill
from engine.dflash.draft import DFlashDraft, DraftConfig, default_layer_ids
from engine.dflash.gguf_io import WRITE_TYPES, DraftFile, load_draft, write_draft_gguf
from engine.dflash.speculative import speculative_generate
from engine.dflash.train_rows import CorpusRows, DistilledRows
from engine.errors import ConfigError
from engine.model.config import ModelConfig
from engine.model.moe import FusedExpertExecutor, TorchExpertExecutor
from engine.model.qwen35moe import Qwen35MoE
from engine.train.batches import BatchSampler, TokenStream, eval_windows
from engine.train.checkpoint import load_checkpoint, save_checkpoint
from engine.train.corpus import iter_documents

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".c", ".h", ".cpp", ".js", ".ts", ".rs", ".go", ".java",
                 ".json", ".jsonl", ".toml", ".yaml", ".yml", ".html", ".tex", ".sh")
QWEN_DFLASH_MASK_ID = 248070  # the mask id of the published Qwen3.5/3.6 drafts; padded vocabularies reach it
LABELS = ("target", "corpus")


def new_draft_config(target: ModelConfig, *, n_layers: int = 5, n_features: int = 5, block_size: int = 16,
                     mask_token_id: int | None = None, layer_ids: tuple[int, ...] | None = None,
                     n_head_kv: int | None = None) -> DraftConfig:
    """A Qwen3-style draft sized for ``target``: heads of 128 (hidden/4 on small targets), a quarter as
    many KV heads unless ``n_head_kv`` says (a divisor of the heads), an FFN three times the hidden size."""
    head_dim = 128 if target.hidden >= 1024 else max(8, target.hidden // 4)
    n_head = max(1, target.hidden // head_dim)
    if mask_token_id is None:
        mask_token_id = QWEN_DFLASH_MASK_ID if target.vocab > QWEN_DFLASH_MASK_ID else target.vocab - 1
    try:
        return DraftConfig(
            n_layers=n_layers, hidden=target.hidden, ffn=3 * target.hidden, n_head=n_head,
            n_head_kv=max(1, n_head // 4) if n_head_kv is None else n_head_kv, head_dim=head_dim,
            rms_eps=target.rms_eps, rope_theta=target.rope_theta,
            block_size=block_size, mask_token_id=mask_token_id,
            target_layer_ids=layer_ids or default_layer_ids(target.n_layers, n_features),
            vocab=target.vocab, context_length=min(target.context_length, 262144))
    except ValueError as exc:
        raise ConfigError(f"draft shape: {exc}") from None


@dataclass(frozen=True)
class TrainOptions:
    steps: int = 2000
    seq_len: int = 2048  # tokens per corpus row
    batch: int = 1  # sequences per step
    anchors: int = 64  # blocks per sequence (trimmed to split into equal groups, see block_loss)
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: default_gamma(block_size)
    labels: str = "target"
    seed: int = 0
    time_budget_s: float | None = None
    ckpt_every: int = 50
    held_out_fraction: float = 0.05
    eval_prompts: int = 8
    eval_prompt_len: int = 128
    eval_new_tokens: int = 128
    weights: str = "bf16"  # type of the draft's matrices in the written GGUF
    distill: int = 0  # > 0: train on this many target continuations instead of corpus windows
    distill_prompt: int = 64  # corpus tokens before each continuation
    distill_new: int = 192  # greedy tokens the target generates after each prompt
    distill_batch: int = 256  # continuations generated together

    def __post_init__(self) -> None:
        positive = {"steps": self.steps, "batch": self.batch, "anchors": self.anchors, "lr": self.lr,
                    "ckpt_every": self.ckpt_every, "eval_prompts": self.eval_prompts,
                    "eval_new_tokens": self.eval_new_tokens}
        if self.distill < 0:
            raise ValueError(f"distill must be 0 (off) or a number of sequences, got {self.distill}")
        self.distill_options  # builds, so validates, the distillation settings
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.seq_len < 8:
            raise ValueError(f"seq_len must be at least 8, got {self.seq_len}")
        if self.eval_prompt_len < 2:
            raise ValueError(f"eval_prompt_len must be at least 2, got {self.eval_prompt_len}")
        if self.weights not in WRITE_TYPES:
            raise ValueError(f"draft weights must be one of {', '.join(WRITE_TYPES)}, got {self.weights!r}")
        if self.labels not in LABELS:
            raise ValueError(f"labels must be one of {LABELS}, got {self.labels!r}")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"gamma must be positive, got {self.gamma}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time budget must be positive, got {self.time_budget_s} s")
        if not 0 < self.held_out_fraction < 1:
            raise ValueError(f"held_out_fraction must be in (0, 1), got {self.held_out_fraction}")

    @property
    def distill_options(self) -> DistillOptions | None:
        if not self.distill:
            return None
        return DistillOptions(self.distill, self.distill_prompt, self.distill_new, self.distill_batch, self.seed)

    def lr_at(self, step: int) -> float:
        """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at ``steps``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        t = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def read_corpus(path: str | Path) -> list[str]:
    """Documents of a text file (split at ``<|endoftext|>``) or of every text file under a directory."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
        if not files:
            raise ConfigError(f"corpus directory {path} holds no text file ({', '.join(TEXT_SUFFIXES)})")
    elif path.is_file():
        files = [path]
    else:
        raise ConfigError(f"corpus {path} does not exist")
    docs = []
    for file in files:
        try:
            docs.extend(d for d in iter_documents(file) if d.strip())
        except UnicodeDecodeError:
            raise ConfigError(f"corpus file {file} is not UTF-8 text") from None
    if not docs:
        raise ConfigError(f"corpus {path} holds no text")
    return docs


def split_documents(docs: list[str], held_out_fraction: float) -> tuple[list[str], list[str]]:
    """A split by content hash (stable across runs and seeds), at least one document on each side."""
    held = [zlib.crc32(d.encode("utf-8")) % 10_000 < held_out_fraction * 10_000 for d in docs]
    if len(docs) < 2:
        raise ConfigError(f"the corpus holds {len(docs)} document; at least 2 are needed (one is held out)")
    if not any(held):
        held[-1] = True
    if all(held):
        held[0] = False
    return [d for d, h in zip(docs, held) if not h], [d for d, h in zip(docs, held) if h]


def training_and_held_out(corpus: str | Path, held_out: str | Path | None,
                          held_out_fraction: float) -> tuple[list[str], list[str], int]:
    """(training documents, held-out documents, held-out documents left out): ``held_out``'s documents
    beside all of ``corpus``'s, less any that the corpus also holds (a file both trees ship), or a
    content-hash split of ``corpus``. A held-out text made only of corpus documents is an error."""
    docs = read_corpus(corpus)
    if held_out is None:
        return *split_documents(docs, held_out_fraction), 0
    given = read_corpus(held_out)
    seen = set(docs)
    held = [d for d in given if d not in seen]
    if not held:
        raise ConfigError(f"held-out text {held_out}: all {len(given)} of its documents are also in the corpus "
                          f"{corpus}; held-out text must be text the draft does not train on")
    return docs, held, len(given) - len(held)


def initial_weights(init: str | Path, cfg: DraftConfig, device: torch.device) -> tuple[dict[str, torch.Tensor], int]:
    """The float32 weights of the draft GGUF ``init``, which must have the shape ``cfg`` describes, and the
    CRC-32 of its file (part of the run's identity)."""
    start = load_draft(init, device=device)
    mine, theirs = asdict(cfg), asdict(start.cfg)
    if diffs := [f"{k} {theirs[k]} (the draft being trained: {mine[k]})" for k in mine if mine[k] != theirs[k]]:
        raise ConfigError(f"initial draft {init} is of another shape: {', '.join(diffs)}")
    return start.state_dict(), zlib.crc32(Path(init).read_bytes())


@dataclass(frozen=True)
class TrainReport:
    steps: int
    train_s: float
    final_loss: float
    teacher_forced_acceptance: float  # the last step's mean over its blocks
    # the last step's median over its rows of their mean: the target's degenerate loops (a row
    # accepted almost whole) pull the mean far above what a typical row gets (docs/benchmarks.md)
    teacher_forced_median_row: float
    held_out: dict[str, Any]
    distill: dict[str, Any] | None = None  # the distilled rows: settings, generation time, agreement

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Progress = Callable[[int, int, dict[str, float]], None]


def train_draft(model: Qwen35MoE, tokenizer, cfg: DraftConfig, corpus: str | Path, out: str | Path,
                opts: TrainOptions, *, target_name: str, target_path: str | Path | None = None,
                held_out: str | Path | None = None, init: str | Path | None = None, resume: bool = True,
                progress: Progress | None = None, distill_progress: Progress | None = None) -> TrainReport:
    """Train a draft for ``model``, write it to ``out`` (GGUF) and a held-out report beside it.

    The report's prompts come from ``held_out`` (a file or directory, as ``corpus``; the draft then
    trains on every document of ``corpus``, none of which may be among them), else from
    ``opts.held_out_fraction`` of ``corpus``'s documents by content hash. Pass held-out text the
    target never trained on either to report what a user's new prompts get: a target continues
    text it learned differently from text it has not seen.

    ``init`` (a draft GGUF of the same shape as ``cfg``) starts training from its weights rather than
    random ones: a draft adapted to other text, or trained on.

    ``progress(step, steps, metrics)`` is called after every step. A checkpoint beside ``out``
    (``<out>.ckpt``) is written every ``ckpt_every`` steps and when the time budget ends the
    loop; with ``resume`` an existing checkpoint of the same run is continued. With
    ``opts.distill`` the target's continuations are generated first from ``target_path`` (its
    GGUF file; ``distill_progress(done, total, metrics)`` follows them) and kept in
    ``<out>.distill.pt`` for a resumed run.
    """
    out = Path(out)
    check_compatible(cfg, model.cfg, draft_name=out.name, target_name=target_name)
    executor = model.executor
    model.executor = pass_executor(model)
    try:
        return _train_draft(model, tokenizer, cfg, corpus, out, opts, target_name=target_name,
                            target_path=target_path, held_out=held_out, init=init, resume=resume, progress=progress,
                            distill_progress=distill_progress)
    finally:
        model.executor = executor


def pass_executor(model: Qwen35MoE) -> Any:
    """The expert executor of the target's training passes: on CUDA the fused-MoE kernels (a few
    launches per layer) in place of the reference executor's loop over experts (a host sync and
    some 250 launches per layer, ~65 ms per 320-token pass of the shipped target on the H200, which
    filled a 4-minute run with 4,096 distilled sequences); any other executor is kept."""
    if model.device.type == "cuda" and isinstance(model.executor, TorchExpertExecutor):
        return FusedExpertExecutor(model.executor.experts, impl="auto", device=model.device)
    return model.executor


def _train_draft(model: Qwen35MoE, tokenizer, cfg: DraftConfig, corpus: str | Path, out: Path, opts: TrainOptions, *,
                 target_name: str, target_path: str | Path | None, held_out: str | Path | None,
                 init: str | Path | None, resume: bool, progress: Progress | None,
                 distill_progress: Progress | None) -> TrainReport:
    device = model.device
    # a draft to start from is checked before the corpus is read and before distillation (minutes on a GPU)
    start, start_crc = initial_weights(init, cfg, device) if init is not None else (None, None)
    train_docs, held_docs, shared = training_and_held_out(corpus, held_out, opts.held_out_fraction)
    held_source = {"source": str(held_out) if held_out is not None
                   else f"{opts.held_out_fraction:g} of the corpus's documents by content hash",
                   "documents": len(held_docs), "left_out_as_in_corpus": shared}
    stream = TokenStream.from_documents(tokenizer.encode(d) for d in train_docs)
    held = TokenStream.from_documents(tokenizer.encode(d) for d in held_docs)
    gamma = opts.gamma or default_gamma(cfg.block_size)
    distilled = None
    if opts.distill_options is not None:
        if target_path is None:
            raise ConfigError("distillation needs the target's GGUF file (target_path)")
        t_distill = time.perf_counter()
        sequences = distill(target_path, stream, opts.distill_options, device=device, cache=cache_path(out),
                            progress=distill_progress)
        distilled = {"sequences": opts.distill, "prompt_len": opts.distill_prompt, "new_tokens": opts.distill_new,
                     "generate_s": round(time.perf_counter() - t_distill, 3)}
        rows = DistilledRows(model, sequences, opts.distill_prompt, cfg.target_layer_ids, opts.labels, opts.batch,
                             opts.seed)
    else:
        sampler = BatchSampler(stream, None, batch_tokens=opts.batch * (opts.seq_len - 1), example_share=0.0,
                               seed=opts.seed)
        rows = CorpusRows(model, sampler, opts.seq_len, cfg.target_layer_ids, opts.labels)
    draft = DFlashDraft(cfg, device=device, dtype=torch.float32).init_random(
        torch.Generator().manual_seed(opts.seed))
    if start is not None:
        draft.load_state_dict(start)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    ckpt = out.with_name(out.name + ".ckpt")
    identity = {"target": target_name, "draft": asdict(cfg), "options": _run_identity(opts),
                "held_out_file": held_out is not None,  # with one, the draft trains on the whole corpus
                "init": start_crc}
    step, spent_before = 0, 0.0
    if resume and ckpt.exists():
        state = load_checkpoint(ckpt, {})
        if state.get("identity") != identity:
            raise ConfigError(f"{ckpt}: the checkpoint belongs to another run (target, draft shape or options "
                              f"differ); pass --restart to start over")
        draft.load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        step, spent_before = state["step"], state["train_s"]
    started, t0 = step, time.perf_counter()

    def save() -> None:
        save_checkpoint(ckpt, {"identity": identity, "draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                               "step": step, "train_s": spent_before + time.perf_counter() - t0})

    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    embed, output = model.weights.embed, model.weights.output
    B = cfg.block_size
    loss_value = accept_value = accept_median = float("nan")
    while step < opts.steps:
        if opts.time_budget_s is not None and time.perf_counter() - t0 >= opts.time_budget_s:
            break
        for group in optimizer.param_groups:
            group["lr"] = opts.lr_at(step)
        batch = rows.batch(step)
        (R, L), first = batch.ids.shape, batch.first_anchor
        n = usable_anchors(min(opts.anchors, L - 1 - first), L, B)
        gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + step)
        anchors = (torch.rand(R, L - 1 - first, generator=gen).argsort(-1)[:, :n] + first).sort(-1).values.to(device)
        total_weight = slot_weights(anchors, L, B, gamma).sum()
        per = rows_per_forward(n, L, B, output.shape[0])
        losses, accepted = [], []
        for r in range(0, R, per):
            part = slice(r, r + per)
            with autocast:
                loss, acc = block_loss(draft, embed, output, batch.features[part], batch.ids[part],
                                       batch.labels[part], anchors[part], gamma)
            share = slot_weights(anchors[part], L, B, gamma).sum() / total_weight
            (loss * share).backward()
            losses.append(loss.detach() * share)
            accepted.append(acc)
        torch.nn.utils.clip_grad_norm_(draft.parameters(), opts.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_value = float(torch.stack(losses).sum())  # the host sync of this step
        per_row = torch.cat(accepted).float().mean(-1)
        accept_value, accept_median = torch.stack([per_row.mean(), per_row.median()]).tolist()
        if progress is not None:
            metrics = {"loss": loss_value, "tf_accept": accept_value, "tf_accept_median": accept_median,
                       "lr": opts.lr_at(step - 1)}
            if distilled is not None:
                metrics["agree"] = rows.agreement
                metrics["passes"] = rows.passes  # each sequence's target pass runs when first drawn
            progress(step, opts.steps, metrics)
        if step % opts.ckpt_every == 0:
            save()
    save()
    spent = spent_before + time.perf_counter() - t0

    write_draft_gguf(draft, out, qtype=opts.weights)
    if distilled is not None:
        agree = rows.agreement
        distilled |= {"target_passes": rows.passes, "agreement": None if math.isnan(agree) else round(agree, 4)}
    held_report = held_out_acceptance(model, DraftFile.open(out), held, cfg, opts) | held_source
    report = TrainReport(steps=step, train_s=round(spent, 3), final_loss=loss_value,
                         teacher_forced_acceptance=accept_value, teacher_forced_median_row=accept_median,
                         held_out=held_report, distill=distilled)
    report_path = out.with_suffix(".acceptance.json")
    report_path.write_text(json.dumps({"target": target_name, "draft": out.name,
                                       "steps_this_run": step - started} | report.as_dict(), indent=2) + "\n")
    return report


def held_out_acceptance(model: Qwen35MoE, draft_file: DraftFile, held: TokenStream, cfg: DraftConfig,
                        opts: TrainOptions) -> dict[str, Any]:
    """Greedy speculative decoding of held-out prompts with the written draft: acceptance length."""
    draft = draft_file.load(device=model.device, dtype=model.dtype)
    try:
        prompts = eval_windows(held, opts.eval_prompt_len - 1, opts.eval_prompts * (opts.eval_prompt_len - 1))
    except ValueError:
        raise ConfigError(f"the held-out documents hold {len(held)} tokens, fewer than one evaluation "
                          f"prompt of {opts.eval_prompt_len}") from None
    per_prompt, spec_tokens, steps = [], 0, 0
    for prompt in prompts[:opts.eval_prompts]:
        _, stats = speculative_generate(model, draft, prompt.tolist(), opts.eval_new_tokens, spec_len=cfg.block_size,
                                        fallback_threshold=0.0)
        per_prompt.append(round(stats.acceptance_length, 4))
        spec_tokens += stats.spec_tokens
        steps += stats.verify_steps
    return {"prompts": len(per_prompt), "prompt_tokens": opts.eval_prompt_len, "new_tokens": opts.eval_new_tokens,
            "spec_len": cfg.block_size, "acceptance_length": round(spec_tokens / steps, 4) if steps else 0.0,
            "per_prompt": per_prompt}


def _run_identity(opts: TrainOptions) -> dict[str, Any]:
    """Options that must match for a checkpoint to continue the same run (not budgets or evaluation)."""
    keep = ("steps", "seq_len", "batch", "anchors", "lr", "min_lr_ratio", "warmup_steps", "weight_decay",
            "gamma", "labels", "seed", "held_out_fraction")
    if opts.distill:
        keep += ("distill", "distill_prompt", "distill_new")
    return {k: getattr(opts, k) for k in keep}
