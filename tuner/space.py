"""The search space, derived from the config and the live hardware, defined by run.

Dimensions appear only where they mean something: the expert budget only with a GPU, the
draft only with compatible candidates, spec_len and the committed-text lookup only with a draft (the
lookup with more than one match length configured, or one other than 0), PFlash only with a
compatible drafter and long prompts, its keep ratio only when it is on, the cold experts' CPU
share only with ``cold_device = "gpu"``, quantized experts and a budget that leaves some cold, the
cold experts fetched and warmed ahead of the router only beside the CPU share (a range wider than
one value configured), the placement unit only with more than one unit configured and a budget that
leaves some cold (but not all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping

from tuner.config import SPEC_LOOKUP_MAX, ApplianceConfig
from engine.hardware import Hardware

NO_DRAFT = "none"


@dataclass(frozen=True)
class TrialParams:
    """One point of the space, as the engine needs it."""

    expert_budget_mb: int | None = None  # None: no GPU, the engine's own placement
    draft: str | None = None  # a candidate's file name
    spec_len: int | None = None
    spec_lookup: int | None = None  # the committed-text lookup's match length with a draft (0: off); None: off
    pflash_keep_ratio: float | None = None
    cold_cpu_share: float | None = None  # share of the cold pairs CPU threads compute; None: not searched
    placement_unit: str | None = None  # what the hot set grows by (engine.placement); None: not searched
    cold_prefetch: int | None = None  # cold experts a layer the bus fetches ahead; None: not searched
    cold_warm: int | None = None  # cold experts a layer the CPU threads warm ahead; None: not searched

    def __post_init__(self) -> None:
        if self.cold_cpu_share is not None and not 0.0 <= self.cold_cpu_share <= 1.0:
            raise ValueError(f"cold_cpu_share {self.cold_cpu_share} is outside [0, 1]")
        for name in ("cold_prefetch", "cold_warm"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} {value} is negative")
        if self.spec_len is not None and self.draft is None:
            raise ValueError(f"spec_len {self.spec_len} is set without a draft")
        if self.draft is not None and self.spec_len is None:
            raise ValueError(f"draft {self.draft!r} has no spec_len")
        if self.spec_lookup is not None:
            if not 0 <= self.spec_lookup <= SPEC_LOOKUP_MAX:
                raise ValueError(f"spec_lookup {self.spec_lookup} is outside 0 (off) .. {SPEC_LOOKUP_MAX}")
            if self.draft is None:
                raise ValueError(f"spec_lookup {self.spec_lookup} is set without a draft")

    def as_dict(self) -> dict[str, Any]:
        """The knobs that are set, by name (what a trial's measurement stores)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def label(self) -> str:
        parts = []
        if self.expert_budget_mb is not None:
            parts.append(f"budget {self.expert_budget_mb} MB")
        parts.append(f"draft {self.draft} x{self.spec_len}" if self.draft else "no draft")
        if self.spec_lookup:
            parts.append(f"lookup {self.spec_lookup}")
        parts.append(f"pflash {self.pflash_keep_ratio:.3f}" if self.pflash_keep_ratio else "no pflash")
        if self.cold_cpu_share is not None:
            parts.append(f"cpu share {self.cold_cpu_share:.2f}")
        if self.placement_unit is not None:
            parts.append(f"by {self.placement_unit}")
        if self.cold_prefetch is not None or self.cold_warm is not None:
            parts.append(f"ahead {self.cold_prefetch or 0} fetched, {self.cold_warm or 0} warmed")
        return ", ".join(parts)


KNOBS = tuple(f.name for f in fields(TrialParams))  # every knob a trial sets, in TrialParams' order


@dataclass(frozen=True)
class SearchSpace:
    budget_max_mb: int | None  # None: no budget dimension (no GPU)
    budget_step_mb: int
    drafts: tuple[str, ...]  # compatible candidates' file names
    spec_len: tuple[int, int]
    keep_ratio: tuple[float, float] | None  # None: no PFlash dimension
    full_model_mb: int | None = None  # the budget that holds every expert, when it fits
    cpu_share: tuple[float, float] | None = None  # None: no CPU-share dimension
    units: tuple[str, ...] | None = None  # None: no placement-unit dimension (one unit, the engine's default)
    prefetch: tuple[int, int] | None = None  # None: no fetched-ahead dimension (with the CPU share's only)
    warm: tuple[int, int] | None = None  # None: no warmed-ahead dimension (with the CPU share's only)
    spec_lookup: tuple[int, ...] | None = None  # the lookup's match lengths with a draft; None: off (the config's [0])

    def __post_init__(self) -> None:
        if self.budget_max_mb is not None and self.budget_max_mb % self.budget_step_mb:
            raise ValueError(f"budget_max_mb {self.budget_max_mb} is not a multiple of "
                             f"the step {self.budget_step_mb}")
        if len(set(self.drafts)) != len(self.drafts) or NO_DRAFT in self.drafts:
            raise ValueError(f"draft names must be distinct and not {NO_DRAFT!r}: {self.drafts}")

    @classmethod
    def build(cls, config: ApplianceConfig, hardware: Hardware, *, drafts: tuple[Path, ...],
              drafter_ok: bool, experts_mb: int) -> "SearchSpace":
        """``drafts`` are the compatible candidates; ``experts_mb``, the routed experts' size as
        the engine holds them, bounds the useful budget."""
        search = config.search
        budget_max = None
        full = None
        if hardware.gpu is not None:
            cap = hardware.gpu.total_mb
            if config.hardware.vram_cap_mb is not None:
                cap = min(cap, config.hardware.vram_cap_mb)
            upper = max(0, cap - config.hardware.vram_reserve_mb)
            if search.expert_budget_max_mb is not None:
                upper = min(upper, search.expert_budget_max_mb)
            step = search.expert_budget_step_mb
            whole = max(1, math.ceil(experts_mb / step)) * step  # every expert on the GPU
            full = whole if whole <= upper else None
            budget_max = min(upper, whole) // step * step
        threshold = search.pflash_threshold
        long_enough = threshold is None or config.workload.long_prompt_tokens > threshold
        pflash = search.pflash and drafter_ok and config.workload.has_long_prompts and long_enough
        share = search.cold_cpu_share
        cpu_share = share if (hardware.gpu is not None and config.engine.cold_device == "gpu"
                              and config.engine.experts == "quantized" and share[1] > 0) else None
        units = search.placement_unit if hardware.gpu is not None and len(search.placement_unit) > 1 else None
        ahead = {name: rng if cpu_share is not None and rng[1] > rng[0] else None
                 for name, rng in (("prefetch", search.cold_prefetch), ("warm", search.cold_warm))}
        lookup = search.spec_lookup if drafts and search.spec_lookup != (0,) else None
        return cls(budget_max_mb=budget_max, budget_step_mb=search.expert_budget_step_mb,
                   drafts=tuple(p.name for p in drafts), spec_len=search.spec_len,
                   keep_ratio=search.pflash_keep_ratio if pflash else None, full_model_mb=full,
                   cpu_share=cpu_share, units=units, spec_lookup=lookup, **ahead)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to choose: one trial says all there is to say."""
        return not self.budget_max_mb and not self.drafts and self.keep_ratio is None

    def suggest(self, trial: Any) -> TrialParams:
        """Ask an Optuna trial for a point, define-by-run."""
        budget = None
        if self.budget_max_mb is not None:
            budget = 0
            if self.budget_max_mb > 0:
                budget = trial.suggest_int("expert_budget_mb", 0, self.budget_max_mb,
                                           step=self.budget_step_mb)
        unit = trial.suggest_categorical("placement_unit", list(self.units)) if self.places_units(budget) else None
        share = prefetch = warm = None
        if self.shares_cold(budget):
            lo, hi = self.cpu_share
            share = trial.suggest_float("cold_cpu_share", lo, hi) if hi > lo else lo
            if self.prefetch is not None:
                prefetch = trial.suggest_int("cold_prefetch", *self.prefetch)
            if self.warm is not None:
                warm = trial.suggest_int("cold_warm", *self.warm)
        draft = spec_len = lookup = None
        if self.drafts:
            choice = trial.suggest_categorical("draft", [NO_DRAFT, *self.drafts])
            if choice != NO_DRAFT:
                draft = choice
                spec_len = trial.suggest_int("spec_len", *self.spec_len)
                if self.spec_lookup is not None:
                    lookup = (trial.suggest_categorical("spec_lookup", list(self.spec_lookup))
                              if len(self.spec_lookup) > 1 else self.spec_lookup[0])
        keep = None
        if self.keep_ratio is not None:
            if trial.suggest_categorical("pflash", ["off", "on"]) == "on":
                keep = trial.suggest_float("pflash_keep_ratio", *self.keep_ratio, log=True)
        return TrialParams(expert_budget_mb=budget, draft=draft, spec_len=spec_len, spec_lookup=lookup,
                           pflash_keep_ratio=keep, cold_cpu_share=share, placement_unit=unit,
                           cold_prefetch=prefetch, cold_warm=warm)

    def places_units(self, budget: int | None) -> bool:
        """Whether a point at ``budget`` has a placement unit to choose: the dimension is on and the budget
        holds some experts but not all (at 0 or the full model's the unit changes nothing)."""
        return (self.units is not None and budget is not None and budget > 0
                and (self.full_model_mb is None or budget < self.full_model_mb))

    def shares_cold(self, budget: int | None) -> bool:
        """Whether a point at ``budget`` has a CPU share to choose: the dimension is on and the
        budget leaves experts cold (below the full model's, or any budget when that is unknown)."""
        return (self.cpu_share is not None and budget is not None
                and (self.full_model_mb is None or budget < self.full_model_mb))

    def params_of(self, stored: Mapping[str, Any]) -> TrialParams:
        """The point an Optuna trial's stored params describe."""
        draft = stored.get("draft", NO_DRAFT)
        budget = stored.get("expert_budget_mb", 0 if self.budget_max_mb is not None else None)
        cold = self.shares_cold(int(budget) if budget is not None else None)
        return TrialParams(
            expert_budget_mb=int(budget) if budget is not None else None,
            draft=None if draft == NO_DRAFT else draft,
            spec_len=int(stored["spec_len"]) if draft != NO_DRAFT else None,
            spec_lookup=(int(stored.get("spec_lookup", self.spec_lookup[0]))
                         if draft != NO_DRAFT and self.spec_lookup is not None else None),
            pflash_keep_ratio=(float(stored["pflash_keep_ratio"])
                               if stored.get("pflash") == "on" else None),
            cold_cpu_share=(float(stored.get("cold_cpu_share", self.cpu_share[0]))
                            if self.shares_cold(int(budget) if budget is not None else None) else None),
            placement_unit=(str(stored.get("placement_unit", self.units[0]))
                            if self.places_units(int(budget) if budget is not None else None) else None),
            cold_prefetch=int(stored.get("cold_prefetch", self.prefetch[0])) if cold and self.prefetch else None,
            cold_warm=int(stored.get("cold_warm", self.warm[0])) if cold and self.warm else None)

    def to_params(self, p: TrialParams) -> dict[str, Any]:
        """The inverse of ``params_of``: what ``enqueue_trial`` takes."""
        out: dict[str, Any] = {}
        if self.budget_max_mb:
            out["expert_budget_mb"] = p.expert_budget_mb
        if self.drafts:
            out["draft"] = p.draft or NO_DRAFT
            if p.draft:
                out["spec_len"] = p.spec_len
                if self.spec_lookup is not None and len(self.spec_lookup) > 1:
                    out["spec_lookup"] = p.spec_lookup if p.spec_lookup is not None else self.spec_lookup[0]
        if self.keep_ratio is not None:
            out["pflash"] = "on" if p.pflash_keep_ratio else "off"
            if p.pflash_keep_ratio:
                out["pflash_keep_ratio"] = p.pflash_keep_ratio
        if self.shares_cold(p.expert_budget_mb) and self.cpu_share[1] > self.cpu_share[0]:
            out["cold_cpu_share"] = p.cold_cpu_share if p.cold_cpu_share is not None else self.cpu_share[0]
        if self.places_units(p.expert_budget_mb):
            out["placement_unit"] = p.placement_unit or self.units[0]
        if self.shares_cold(p.expert_budget_mb):
            if self.prefetch is not None:
                out["cold_prefetch"] = p.cold_prefetch if p.cold_prefetch is not None else self.prefetch[0]
            if self.warm is not None:
                out["cold_warm"] = p.cold_warm if p.cold_warm is not None else self.warm[0]
        return out

    def warm_start(self) -> list[TrialParams]:
        """Informative first points: all experts on the GPU (or as many as fit) and plain
        decoding; the matched draft at a middle spec_len, with the first lookup match length and then the
        longest; PFlash at a middle keep ratio; half the budget."""
        top = self.full_model_mb if self.full_model_mb is not None else self.budget_max_mb
        points = [TrialParams(expert_budget_mb=top)]
        if self.drafts:
            middle = (self.spec_len[0] + self.spec_len[1]) // 2
            lookups = ([None] if self.spec_lookup is None
                       else list(dict.fromkeys((self.spec_lookup[0], max(self.spec_lookup)))))
            points += [TrialParams(expert_budget_mb=top, draft=self.drafts[0], spec_len=middle, spec_lookup=k)
                       for k in lookups]
        if self.keep_ratio is not None:
            lo, hi = self.keep_ratio
            points.append(TrialParams(expert_budget_mb=top, pflash_keep_ratio=math.sqrt(lo * hi)))
        if self.budget_max_mb:
            half = self.budget_max_mb // 2 // self.budget_step_mb * self.budget_step_mb
            if half != top:
                unit = self.units[0] if self.places_units(half) else None
                if self.shares_cold(half):  # the bus alone, then the middle of the threads' share
                    lo, hi = self.cpu_share
                    low = dict(cold_prefetch=self.prefetch[0] if self.prefetch else None,
                               cold_warm=self.warm[0] if self.warm else None)
                    points += [TrialParams(expert_budget_mb=half, cold_cpu_share=lo, placement_unit=unit, **low)]
                    if hi > lo:
                        points.append(TrialParams(expert_budget_mb=half, cold_cpu_share=(lo + hi) / 2,
                                                  placement_unit=unit, **low))
                    if self.prefetch or self.warm:  # there, the most fetched and warmed ahead
                        points.append(replace(points[-1], cold_prefetch=self.prefetch[1] if self.prefetch else None,
                                              cold_warm=self.warm[1] if self.warm else None))
                else:
                    points.append(TrialParams(expert_budget_mb=half, placement_unit=unit))
                if unit is not None:  # the other units at the last of those points
                    points += [replace(points[-1], placement_unit=u) for u in self.units[1:]]
        return points

    def coarse_grid(self, budget_points: int = 4) -> list[TrialParams]:
        """Every combination of a few values per knob: the budget at ``budget_points`` even steps
        from 0 to the maximum, no draft or each draft at the lowest, middle and highest
        spec_len with each lookup match length, PFlash off or at the lowest, geometric-middle and
        highest keep ratio, the cold experts fetched and warmed ahead at each end of their ranges.
        The exhaustive reference a study's best is compared against."""
        budgets: list[int | None] = [None]
        if self.budget_max_mb:
            step = self.budget_step_mb
            budgets = sorted({round(self.budget_max_mb * i / (budget_points - 1) / step) * step
                              for i in range(budget_points)})
        lo, hi = self.spec_len
        lookups: list[int | None] = list(self.spec_lookup) if self.spec_lookup is not None else [None]
        drafts: list[tuple[str | None, int | None, int | None]] = [(None, None, None)]
        drafts += [(d, n, k) for d in self.drafts for n in sorted({lo, (lo + hi) // 2, hi}) for k in lookups]
        keeps: list[float | None] = [None]
        if self.keep_ratio is not None:
            k_lo, k_hi = self.keep_ratio
            keeps += [k_lo, math.sqrt(k_lo * k_hi), k_hi]
        def shares(b: int | None) -> list[float | None]:
            if not self.shares_cold(b):
                return [None]
            lo, hi = self.cpu_share
            return sorted({lo, (lo + hi) / 2, hi})

        def units(b: int | None) -> list[str | None]:
            return list(self.units) if self.places_units(b) else [None]

        def ahead(b: int | None, rng: tuple[int, int] | None) -> list[int | None]:
            return sorted(set(rng)) if rng is not None and self.shares_cold(b) else [None]

        return [TrialParams(expert_budget_mb=b, draft=d, spec_len=n, spec_lookup=m, pflash_keep_ratio=k,
                            cold_cpu_share=s, placement_unit=u, cold_prefetch=f, cold_warm=w)
                for b in budgets for u in units(b) for s in shares(b) for f in ahead(b, self.prefetch)
                for w in ahead(b, self.warm) for d, n, m in drafts for k in keeps]

    def describe(self) -> dict[str, Any]:
        """A JSON form stored with the study: resuming with another space is refused."""
        return {"budget_max_mb": self.budget_max_mb, "budget_step_mb": self.budget_step_mb,
                "drafts": list(self.drafts), "spec_len": list(self.spec_len),
                **({"spec_lookup": list(self.spec_lookup)} if self.spec_lookup is not None else {}),
                "keep_ratio": list(self.keep_ratio) if self.keep_ratio else None,
                **({"cpu_share": list(self.cpu_share)} if self.cpu_share else {}),
                **({"placement_units": list(self.units)} if self.units else {}),
                **({"cold_prefetch": list(self.prefetch)} if self.prefetch else {}),
                **({"cold_warm": list(self.warm)} if self.warm else {})}
