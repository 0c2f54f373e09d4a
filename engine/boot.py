"""Booting the engine from a published profile, or from a safe default when it does not hold."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import EngineError
from engine.hardware import Nvml, cuda_available, detect_hardware
from engine.profile import Profile, ProfileError, load_profile, model_hashes, verify_profile

SMOKE_PROMPT = "def fibonacci(n):"
SMOKE_TOKENS = 8


@dataclass(frozen=True)
class Boot:
    engine: Any
    profile: Profile | None  # None: the safe default was loaded instead
    problems: tuple[str, ...]  # why the profile was not used
    smoke_text: str
    smoke_tok_s: float
    generate_options: dict[str, Any]  # what generate() should be called with from now on

    @property
    def fell_back(self) -> bool:
        return self.profile is None


def boot(profile_path: str | Path, *, fallback_target: str | Path, fallback_device: str = "auto",
         smoke_tokens: int = SMOKE_TOKENS) -> Boot:
    """Verify the profile against this machine and its model files, load the engine with its
    settings and run a short smoke generation. Anything that does not match, or fails to
    load or generate, falls back to the target alone with the engine's defaults."""
    from engine.engine import Engine

    profile, problems = check_profile(profile_path)
    if profile is not None:
        try:
            engine = Engine.from_gguf(profile.models["target"].path, **profile.load_options())
            options = profile.generate_options()
            text, tok_s = _smoke(engine, options, smoke_tokens)
            return Boot(engine, profile, (), text, tok_s, options)
        except EngineError as exc:
            problems = [f"the profile's settings failed on this machine: {exc}"]
            profile = None
    engine = Engine.from_gguf(fallback_target, device=fallback_device)
    text, tok_s = _smoke(engine, {}, smoke_tokens)
    return Boot(engine, None, tuple(problems), text, tok_s, {})


def check_profile(path: str | Path) -> tuple[Profile | None, list[str]]:
    """The profile when it holds here, else None and every reason it does not."""
    try:
        profile = load_profile(path)
    except ProfileError as exc:
        return None, [str(exc)]
    device = str(profile.engine.get("device", "auto"))
    nvml = Nvml.open() if device != "cpu" else None
    try:
        here = detect_hardware(nvml, device, torch_cuda=nvml is not None and cuda_available())
    finally:
        if nvml is not None:
            nvml.close()
    problems = verify_profile(profile, here.fingerprint.as_dict(), model_hashes(profile))
    return (None if problems else profile), problems


def _smoke(engine: Any, options: dict[str, Any], n: int) -> tuple[str, float]:
    gen = engine.generate(engine.tokenizer.encode(SMOKE_PROMPT), n, temperature=0.0, **options)
    return gen.text, float(gen.timings.decode_tok_s)
