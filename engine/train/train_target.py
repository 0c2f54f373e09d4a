"""Training of one member of the shipped qwen35moe family with transformers' Qwen3_5MoeForCausalLM.

The HF model is the oracle the engine is tested against, so training it (and converting it
with ``engine.gguf.convert_hf``) gives files the engine must read exactly. On CUDA the
forward runs under bf16 autocast with fp32 master weights, with fla's Gated DeltaNet kernels
where fla can train (``fla_trains_on``) and transformers' torch path elsewhere; on the CPU
everything runs in fp32 through the torch paths.

Under a time budget the number of steps is planned once, from timed steps at both sequence
lengths, so the cosine schedule and the curriculum end together before the deadline; the
deadline also stops the loop outright. ``--steps N`` runs exactly N steps: together with the
seed it fixes the batches, the initial weights and the schedule.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from engine.errors import ConfigError
from engine.train.batches import BatchSampler, Curriculum, TokenStream
from engine.train.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from engine.train.family import ModelShape, shape as shape_named


@dataclass(frozen=True)
class TrainConfig:
    shape: str = "target"
    seed: int = 0
    steps: int | None = None
    minutes: float | None = None
    batch_tokens: int = 131072
    curriculum: Curriculum = field(default_factory=Curriculum)
    example_share: float = 0.25  # rows that start at a retrieval example
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    router_aux_loss_coef: float = 1e-3  # transformers' default; weak enough to leave routing skewed
    ckpt_every: int = 100
    calibration_steps: int = 6
    time_safety: float = 0.92  # share of the measured step budget the plan uses
    sync_every: int = 10  # steps between reads of the loss from the device
    experts_implementation: str | None = None  # None: see experts_implementation_for

    def __post_init__(self) -> None:
        shape_named(self.shape)
        if self.steps is None and self.minutes is None:
            raise ValueError("give a step count, a time budget in minutes, or both")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.minutes is not None and self.minutes <= 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")
        positive = {"batch_tokens": self.batch_tokens, "lr": self.lr, "ckpt_every": self.ckpt_every,
                    "calibration_steps": self.calibration_steps, "sync_every": self.sync_every}
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.calibration_steps < 2:
            raise ValueError(f"calibration_steps must be at least 2 (the first is warm-up), "
                             f"got {self.calibration_steps}")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"warmup_steps {self.warmup_steps} must be >= 0 and min_lr_ratio "
                             f"{self.min_lr_ratio} in [0, 1]")
        if not 0.0 < self.time_safety <= 1.0:
            raise ValueError(f"time_safety must lie in (0, 1], got {self.time_safety}")

    @property
    def model_shape(self) -> ModelShape:
        return shape_named(self.shape)

    def lr_at(self, step: int, total_steps: int | None) -> float:
        """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at ``total_steps``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if total_steps is None:
            return self.lr
        span = max(1, total_steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        floor = self.min_lr_ratio * self.lr
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * t))

    def identity(self, vocab: int) -> dict[str, Any]:
        return {"shape": self.model_shape.as_dict(), "vocab": vocab, "seed": self.seed,
                "batch_tokens": self.batch_tokens, "curriculum": asdict(self.curriculum),
                "example_share": self.example_share, "lr": self.lr}

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


# Per-member defaults: the drafter is small enough for a higher learning rate.
PRESETS: dict[str, dict[str, Any]] = {
    # Retrieval is what the target must learn beyond next-token statistics: more, smaller
    # steps and a larger share of retrieval rows than the drafter, which only scores prompts.
    "target": {"lr": 2e-3, "batch_tokens": 65536, "example_share": 0.4},
    "drafter": {"lr": 3e-3, "batch_tokens": 131072},
}


def preset_config(name: str, **overrides: Any) -> TrainConfig:
    """The training config of a shipped member, with ``overrides`` (steps, minutes, seed...)."""
    if name not in PRESETS:
        raise ValueError(f"unknown training preset {name!r}; expected one of {sorted(PRESETS)}")
    return TrainConfig(shape=name, **(PRESETS[name] | overrides))


@dataclass(frozen=True)
class TrainData:
    """Token streams of one corpus under one tokenizer."""

    train: TokenStream
    heldout: TokenStream
    vocab: int
    examples: TokenStream | None = None  # retrieval examples for training rows
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("train", "heldout", "examples"):
            stream = getattr(self, name)
            if stream is not None and len(stream) and int(stream.ids.max()) >= self.vocab:
                raise ValueError(f"{name} stream holds token id {int(stream.ids.max())}, "
                                 f"outside the vocabulary of {self.vocab}")


@dataclass(frozen=True)
class StepInfo:
    step: int
    planned_steps: int | None
    loss: float | None
    lr: float
    seq_len: int
    tokens_per_s: float


@dataclass(frozen=True)
class TrainResult:
    steps: int
    planned_steps: int
    tokens: int
    train_seconds: float
    stopped_by: str  # "steps" (the asked count), "plan" (the count planned for the budget) or "time"
    final_loss: float | None
    loss_history: tuple[tuple[int, float], ...]
    resumed_from: int | None
    device: str
    gdn_kernel: str
    experts_implementation: str

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_seconds if self.train_seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["loss_history"] = [list(p) for p in self.loss_history]
        d["tokens_per_s"] = self.tokens_per_s
        return d


HF_MODELING = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"


def fla_trains_on(device: torch.device) -> bool:
    """Whether fla's Gated DeltaNet kernels can train on ``device``.

    fla 0.6 refuses its gated chunk backward on Hopper GPUs under Triton 3.4 to 3.7.0, whose
    code for it is wrong (fla issue #640); the forward alone would run, the first backward not.
    """
    if device.type != "cuda" or importlib.util.find_spec("fla") is None:
        return False
    import triton
    from packaging.version import Version

    hopper = torch.cuda.get_device_capability(device)[0] == 9
    return not (hopper and Version("3.4.0") <= Version(triton.__version__) < Version("3.7.1"))


def hf_model_class(use_fla: bool) -> tuple[type, str]:
    """(transformers' Qwen3_5MoeForCausalLM, the Gated DeltaNet kernel its module bound).

    transformers binds fla's kernels into the module when it is first imported and fla is
    importable; without ``use_fla`` it is imported with fla hidden, so the torch path is bound.
    A module imported earlier in this process keeps what it bound then (in a fresh process,
    as the train command runs, the first import is this one).
    """
    if HF_MODELING in sys.modules:
        bound = "fla" if use_fla and "fla" in sys.modules else "torch"
        return sys.modules[HF_MODELING].Qwen3_5MoeForCausalLM, bound
    if use_fla:
        return importlib.import_module(HF_MODELING).Qwen3_5MoeForCausalLM, "fla"
    hidden = {name: sys.modules.pop(name) for name in list(sys.modules) if name.split(".")[0] == "fla"}
    sys.modules["fla"] = None  # "import fla" now fails
    try:
        return importlib.import_module(HF_MODELING).Qwen3_5MoeForCausalLM, "torch"
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)


def experts_implementation_for(device: torch.device) -> str | None:
    """transformers' experts implementation for training on ``device`` (None: its own default).

    On the H200, torch's grouped GEMM trained the target at 255K tokens/s where the
    per-expert loop managed 72K (the drafter: 827K against 405K), so CUDA takes the grouped GEMM.
    """
    return "grouped_mm" if device.type == "cuda" else None


def build_model(cfg: TrainConfig, data: TrainData, device: torch.device):
    """(the seeded, freshly initialised HF model of ``cfg``'s shape on ``device`` in fp32, GDN kernel)."""
    model_class, gdn_kernel = hf_model_class(fla_trains_on(device))
    options: dict[str, Any] = {"router_aux_loss_coef": cfg.router_aux_loss_coef, "use_cache": False}
    experts = cfg.experts_implementation or experts_implementation_for(device)
    if experts is not None:
        options["experts_implementation"] = experts
    hf_cfg = cfg.model_shape.hf_config(data.vocab, bos_id=data.bos_id, eos_id=data.eos_id,
                                       pad_id=data.pad_id, **options)
    torch.manual_seed(cfg.seed)
    return model_class(hf_cfg).to(device), gdn_kernel


def _optimizer(model, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=device.type == "cuda")


class _Trainer:
    """One model's forward, backward and optimiser step, sharing what every step needs."""

    def __init__(self, model, opt, cfg: TrainConfig, sampler: BatchSampler, device: torch.device) -> None:
        self.model, self.opt, self.cfg, self.sampler, self.device = model, opt, cfg, sampler, device
        self.autocast = device.type == "cuda"

    def loss(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(next-token loss, loss with the router's load-balancing term) of one batch."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(input_ids=inputs, use_cache=False,
                             output_router_logits=self.cfg.router_aux_loss_coef > 0)
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten())
        if self.cfg.router_aux_loss_coef > 0:
            return loss, loss + self.cfg.router_aux_loss_coef * out.aux_loss.float()
        return loss, loss

    def fetch(self, step: int, seq_len: int) -> torch.Tensor:
        batch = self.sampler.batch(step, seq_len)
        if self.device.type == "cuda":
            batch = batch.pin_memory()
        return batch.to(self.device, non_blocking=True)

    def step(self, step: int, seq_len: int, lr: float) -> torch.Tensor:
        for group in self.opt.param_groups:
            group["lr"] = lr
        lm_loss, total = self.loss(self.fetch(step, seq_len))
        total.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return lm_loss.detach()

    def time_probe(self, seq_len: int, repeats: int = 2) -> float:
        """Seconds of one forward and backward at ``seq_len``; gradients are discarded."""
        seconds = 0.0
        for i in range(repeats):
            batch = self.fetch(10**9 + i, seq_len)
            _sync(self.device)
            t0 = time.perf_counter()
            self.loss(batch)[1].backward()
            _sync(self.device)
            seconds = time.perf_counter() - t0
        self.opt.zero_grad(set_to_none=True)
        return seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Progress:
    """What a run has done so far: the part of its state a checkpoint carries besides the weights."""

    step: int = 0
    tokens: int = 0
    seconds: float = 0.0  # training time of earlier runs of this checkpoint
    planned: int | None = None
    history: list[tuple[int, float]] = field(default_factory=list)
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)

    def flush(self) -> None:
        """Read the losses still on the device (one host synchronisation)."""
        if self.pending:
            values = torch.stack([v for _, v in self.pending]).tolist()
            self.history.extend((s, v) for (s, _), v in zip(self.pending, values))
            self.pending.clear()

    @property
    def last_loss(self) -> float | None:
        return self.history[-1][1] if self.history else None


def train(cfg: TrainConfig, data: TrainData, *, device: torch.device, ckpt_dir: Path | None = None,
          resume: bool = False, deadline: float | None = None,
          on_step: Callable[[StepInfo], None] | None = None):
    """Train ``cfg``'s model on ``data``; returns (model on ``device``, TrainResult).

    ``deadline`` is a ``time.monotonic()`` instant at which training stops whatever the plan;
    ``cfg.minutes`` sets one from now when ``deadline`` is not given. With ``ckpt_dir`` a
    checkpoint is written every ``cfg.ckpt_every`` steps and at the end; ``resume`` continues
    from it, on the batches and schedule the uninterrupted run would have had.
    """
    if deadline is None and cfg.minutes is not None:
        deadline = time.monotonic() + 60.0 * cfg.minutes
    model, gdn_kernel = build_model(cfg, data, device)
    model.train()
    opt = _optimizer(model, cfg, device)
    identity = cfg.identity(data.vocab)
    sampler = BatchSampler(stream=data.train, examples=data.examples, batch_tokens=cfg.batch_tokens,
                           example_share=cfg.example_share, seed=cfg.seed)
    trainer = _Trainer(model, opt, cfg, sampler, device)
    run = _Progress(planned=cfg.steps)
    resumed_from = None
    ckpt = checkpoint_path(ckpt_dir, cfg.shape) if ckpt_dir is not None else None
    if resume and ckpt is not None and ckpt.exists():
        state = load_checkpoint(ckpt, identity)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        run = _Progress(step=state["step"], tokens=state["tokens"], seconds=state["train_seconds"],
                        planned=state["planned_steps"] if cfg.steps is None else cfg.steps,
                        history=[tuple(p) for p in state["loss_history"]])
        resumed_from = run.step
    t_loop = time.monotonic()

    def elapsed() -> float:
        return run.seconds + time.monotonic() - t_loop

    def save() -> None:
        if ckpt is not None:
            run.flush()
            save_checkpoint(ckpt, {"identity": identity, "model": model.state_dict(),
                                   "optimizer": opt.state_dict(), "step": run.step, "tokens": run.tokens,
                                   "planned_steps": run.planned, "train_seconds": elapsed(),
                                   "loss_history": run.history, "config": cfg.as_dict()})

    calibration_start, t_calibration = run.step, None
    stopped_by = "steps"
    while run.planned is None or run.step < run.planned:
        if deadline is not None and time.monotonic() >= deadline:
            stopped_by = "time"
            break
        seq_len = (cfg.curriculum.seq_len(run.step, run.planned) if run.planned is not None
                   else cfg.curriculum.short_len)
        lr = cfg.lr_at(run.step, run.planned)
        loss = trainer.step(run.step, seq_len, lr)
        run.step += 1
        run.tokens += sampler.rows(seq_len) * seq_len
        run.pending.append((run.step, loss))
        if run.planned is None:
            if run.step - calibration_start == 1:
                _sync(device)
                t_calibration = time.perf_counter()
            elif run.step - calibration_start == cfg.calibration_steps:
                run.planned = _plan(cfg, trainer, run.step, calibration_start, t_calibration, deadline)
        if len(run.pending) >= cfg.sync_every:
            run.flush()
            if not math.isfinite(run.last_loss):
                raise ConfigError(f"{cfg.shape} training diverged at step {run.step} (loss {run.last_loss}); "
                                  f"lower the learning rate {cfg.lr:g}")
        if run.step % cfg.ckpt_every == 0:
            save()
        if on_step is not None:
            on_step(StepInfo(step=run.step, planned_steps=run.planned, loss=run.last_loss, lr=lr,
                             seq_len=seq_len, tokens_per_s=run.tokens / max(elapsed(), 1e-9)))
    if stopped_by != "time" and (cfg.steps is None or run.step < cfg.steps):
        stopped_by = "plan"  # the step count planned to fit the time budget
    run.flush()
    save()
    _sync(device)
    result = TrainResult(
        steps=run.step, planned_steps=run.planned if run.planned is not None else run.step,
        tokens=run.tokens, train_seconds=elapsed(), stopped_by=stopped_by, final_loss=run.last_loss,
        loss_history=tuple(run.history), resumed_from=resumed_from, device=_device_name(device),
        gdn_kernel=gdn_kernel,
        experts_implementation=str(getattr(model.config, "_experts_implementation", "eager")))
    return model, result


def _plan(cfg: TrainConfig, trainer: _Trainer, step: int, calibration_start: int,
          t_calibration: float | None, deadline: float | None) -> int | None:
    """Total steps that fit before ``deadline``, from the timed short steps and a long-sequence probe."""
    if deadline is None or t_calibration is None:
        return cfg.steps
    _sync(trainer.device)
    short_s = (time.perf_counter() - t_calibration) / (step - calibration_start - 1)
    long_s = short_s
    if cfg.curriculum.long_fraction > 0 and cfg.curriculum.long_len != cfg.curriculum.short_len:
        # the probes time forward and backward alone; their ratio scales the measured whole step
        ratio = trainer.time_probe(cfg.curriculum.long_len) / trainer.time_probe(cfg.curriculum.short_len)
        long_s = short_s * max(1.0, ratio)
    remaining = max(0.0, deadline - time.monotonic()) * cfg.time_safety
    f = cfg.curriculum.long_fraction
    # step + n = total, with (total - step) steps of which a share f are long
    n = int(remaining / ((1.0 - f) * short_s + f * long_s))
    total = step + n
    return min(total, cfg.steps) if cfg.steps is not None else total


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(device)
