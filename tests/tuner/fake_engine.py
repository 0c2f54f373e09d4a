"""A test double of engine.Engine for exercising the tuner's machinery quickly.

It has the stable API's surface (``from_gguf`` with draft/drafter/budget, ``generate`` with
spec_len, spec_lookup and pflash_keep_ratio, ``set_expert_budget``, ``tokenizer``) and the real
tokenizer of the target file, but no model: greedy ids are a fixed function of the prompt,
and time per token falls with the expert budget and speculation, so a search has something
to find. A JSON file next to the target (``<target>.fake.json``) says which drafts are
incompatible, lossy or tied (their last token flipped where plain decoding's margin is
``last_margin_ulps``), and whether to crash, so tests can provoke every failure path.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from engine.errors import IncompatibleModelError
from engine.tokenizer import Tokenizer


@dataclass
class Timings:  # the fields of engine.engine.Timings, without importing torch
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    decode_tok_s: float
    peak_mem_mb: float
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


@dataclass
class Generation:
    ids: list[int]
    text: str
    timings: Timings
    stop_reason: str


class OutOfMemoryError(RuntimeError):
    """Named like torch.cuda.OutOfMemoryError, which is how the worker recognises one."""


class FakeEngine:
    def __init__(self, target: Path, behaviour: dict[str, Any], draft: str | None,
                 drafter: str | None, budget_mb: int | None) -> None:
        self.behaviour = behaviour
        self.tokenizer = Tokenizer.from_gguf(target)
        self.device = "cpu"
        self.draft = draft
        self.drafter = drafter
        self.budget_mb = 0
        self.cpu_share = 0.0
        self.ahead = (0, 0)  # cold experts fetched and warmed ahead a layer
        self.unit = "expert"
        self.set_expert_budget(budget_mb or 0)

    @classmethod
    def from_gguf(cls, path: str | Path, *, device: str = "auto", dtype: str | None = None,
                  threads: int | None = None, expert_budget_mb: int | None = None,
                  draft: str | None = None, drafter: str | None = None,
                  pflash_threshold: int | None = None, **options: Any) -> "FakeEngine":
        sidecar = Path(f"{path}.fake.json")
        behaviour = json.loads(sidecar.read_text()) if sidecar.exists() else {}
        if behaviour.get("crash_on_load"):
            os._exit(3)
        for role, other in (("draft", draft), ("drafter", drafter)):
            if other is not None and Path(other).name in behaviour.get("incompatible", []):
                raise IncompatibleModelError(
                    f"{other}: {role} hidden size 5120 does not match the target's 2048")
        eng = cls(Path(path), behaviour, draft, drafter, expert_budget_mb)
        eng.unit = options.get("placement_unit") or "expert"
        return eng

    def set_expert_budget(self, mb: int, *, unit: str | None = None) -> None:
        if mb > self.behaviour.get("oom_above_mb", float("inf")):
            raise OutOfMemoryError(f"CUDA out of memory: tried to place {mb} MB of experts")
        self.budget_mb = mb
        if unit is not None:
            self.unit = unit

    def set_cold_cpu_share(self, share: float) -> None:
        self.cpu_share = share

    def set_cold_prefetch(self, n: int, *, warm: int | None = None) -> None:
        self.ahead = (n, self.ahead[1] if warm is None else warm)

    def generate(self, ids: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, stop: Any = None,
                 ignore_eos: bool = False, spec_len: int | None = None, pflash_keep_ratio: float | None = None,
                 spec_lookup: int | None = None) -> Generation:
        if self.behaviour.get("crash_on_generate"):
            os._exit(4)
        vocab = self.tokenizer.vocab_size
        base = sum(ids) * 31 + len(ids)
        new = [(base + 7 * i) % vocab for i in range(max_new_tokens)]
        if spec_len and self.draft and Path(self.draft).name in self.behaviour.get("lossy", []) + self.behaviour.get("tied", []):
            new[-1] = (new[-1] + 1) % vocab
        ms = float(self.behaviour.get("ms_per_token", 2.0))
        ms /= 1.0 + self.budget_mb / 1024.0
        ms *= 1.0 - 0.3 * self.cpu_share  # CPU threads beside the bus: faster cold experts
        ms *= 1.0 - 0.02 * sum(self.ahead) * self.cpu_share  # fetched and warmed ahead beside the threads
        ms *= 0.9 if self.unit == "layer" else 1.0  # fewer layers with cold experts
        if spec_len and self.draft:
            ms /= 1.0 + 0.1 * spec_len
            ms *= 0.8 if spec_lookup else 1.0  # copied blocks accepted whole
        prompt = len(ids) * (pflash_keep_ratio or 1.0)
        prefill_s = prompt * ms / 20_000.0
        decode_s = (max_new_tokens - 1) * ms / 1000.0
        time.sleep(prefill_s + decode_s)
        timings = Timings(prompt_tokens=len(ids), new_tokens=max_new_tokens, prefill_s=prefill_s,
                          decode_s=decode_s, decode_tok_s=(max_new_tokens - 1) / decode_s,
                          peak_mem_mb=100.0 + self.budget_mb,
                          extra={**({"acceptance_length": 1.0 + spec_len / 2, "lookup": spec_lookup or 0}
                                    if spec_len else {}),
                                 **({"cold_cpu_share": self.cpu_share} if self.cpu_share else {}),
                                 **({"placement_unit": self.unit} if self.unit != "expert" else {})})
        return Generation(ids=new, text=self.tokenizer.decode(new), timings=timings,
                          stop_reason="length")

    def greedy_margins(self, ids: Sequence[int], new: Sequence[int]) -> list[float]:
        """Every gap wide (100 ulps) except the last token's, ``last_margin_ulps`` (default 100):
        a "tied" draft's flip of the last token then falls on a tie when it is 0."""
        return [100.0] * (len(new) - 1) + [float(self.behaviour.get("last_margin_ulps", 100.0))]
