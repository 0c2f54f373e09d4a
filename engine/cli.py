"""Engine commands of the ``luce-tune`` CLI: generate, inspect, make-model, convert."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from engine.errors import ConfigError


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
    app.command("inspect")(inspect)
    app.command("make-model")(make_model)
    app.command("convert")(convert)
    app.command("calibrate")(calibrate)


def generate(
    model: Path = typer.Option(..., "--model", "-m", help="qwen35moe GGUF file"),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="prompt text"),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="read the prompt from a file"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
    temperature: float = typer.Option(0.0, "--temperature", "-t"),
    top_p: float = typer.Option(1.0, "--top-p"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    device: str = typer.Option("auto", "--device"),
    dtype: Optional[str] = typer.Option(None, "--dtype"),
    threads: Optional[int] = typer.Option(None, "--threads"),
    expert_budget: Optional[float] = typer.Option(
        None, "--expert-budget", help="MB of device memory for routed experts; the rest run on CPU threads"),
    cold_format: str = typer.Option(
        "dense", "--cold-format", help="how CPU-side experts are held: dense or quantized (GGUF blocks, "
        "torch's CPU weight-only kernels)"),
    hot_format: str = typer.Option(
        "dense", "--hot-format", help="how GPU-side experts are held: dense or quantized (GGUF blocks, "
        "dequantized in the kernels; the budget then counts quantized bytes); quantized needs --cold-format quantized"),
    cold_device: str = typer.Option(
        "cpu", "--cold-device", help="what computes the cold experts: cpu (CPU threads) or gpu (the GPU reads "
        "their pinned host copies over the bus; no host sync, so the decode step is captured with them too)"),
    cold_cpu_share: Optional[float] = typer.Option(
        None, "--cold-cpu-share", help="with --cold-device gpu: share (0-1) of the cold experts computed by CPU "
        "threads beside the bus in decode steps (Q4_0/Q8_0 experts; one thread per core but one)"),
    cold_cpu_int8: bool = typer.Option(
        True, "--cold-cpu-int8/--cold-cpu-float32", help="with --cold-cpu-share: the threads round activations to "
        "8 bits per 32 values and multiply in integers, as llama.cpp's CPU experts do (the default), or multiply "
        "in float32"),
    cold_prefetch: Optional[int] = typer.Option(
        None, "--cold-prefetch", help="with --cold-cpu-share: cold experts a layer (0-4) the bus fetches ahead of "
        "the layer's router from its routing predicted at the layer's start, or at the start of the layer before "
        "where that one's experts are all hot (decode steps of one token; LUCE_TUNE_COLD_AHEAD=0: always its own)"),
    cold_warm: Optional[int] = typer.Option(
        None, "--cold-warm", help="with --cold-cpu-share: cold experts a layer (0-8) after --cold-prefetch's that the "
        "CPU threads fetch into their caches ahead of the router, then compute"),
    placement_unit: Optional[str] = typer.Option(
        None, "--placement-unit", help="with --expert-budget: what the hot set grows by: expert (the most-routed "
        "experts of any layer; the default), layer (whole layers, so fewer layers have cold experts, as "
        "llama.cpp's -ncmoe) or alternate (whole layers, every other one first, so that each cold layer follows a "
        "hot one, whose time --cold-prefetch and --cold-warm use)"),
    weights: str = typer.Option(
        "dense", "--weights", help="dense (dequantized at load) or quantized (projection matrices kept as GGUF "
        "blocks, dequantized in the matmul kernels)"),
    drafter: Optional[Path] = typer.Option(None, "--drafter", help="PFlash drafter GGUF (same vocabulary)"),
    keep_ratio: Optional[float] = typer.Option(None, "--keep-ratio", help="PFlash: share of prompt chunks kept"),
    draft: Optional[Path] = typer.Option(None, "--draft", help="DFlash draft GGUF (checked against the target)"),
    spec_len: Optional[int] = typer.Option(None, "--spec-len", help="DFlash: tokens verified per target forward"),
    spec_fallback: Optional[str] = typer.Option(
        None, "--spec-fallback", help="DFlash: acceptance length under which plain decoding takes a stretch of the "
        "generation before speculation is tried again (default 1.2; 0: speculate throughout; auto: where "
        "speculation commits tokens more slowly than timed plain steps)"),
    spec_lookup: Optional[int] = typer.Option(
        None, "--spec-lookup", help="DFlash: where the last N committed tokens occurred before, a block copies what "
        "followed them instead of the draft's proposal (0: off, the default; 3 is a sensible value); the output "
        "is unchanged"),
    cuda_graph: bool = typer.Option(
        True, "--cuda-graph/--no-cuda-graph", help="replay plain decoding and prefills up to 2,048 tokens from "
        "captured CUDA graphs where the configuration allows it (on a GPU, no experts on CPU threads); "
        "--no-cuda-graph runs everything eagerly"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object instead of streaming"),
) -> None:
    """Generate a continuation of a prompt, streaming the text, then the timings."""
    from engine.engine import Engine

    text = _read_prompt(prompt, prompt_file)
    if keep_ratio is not None and drafter is None:
        raise ConfigError("--keep-ratio needs --drafter")
    if draft is not None and spec_len is None:
        spec_len = 8
    if spec_len is not None and draft is None:
        raise ConfigError("--spec-len needs --draft")
    fallback = None if spec_fallback is None else _spec_fallback(spec_fallback, draft)
    if spec_lookup is not None:
        if draft is None:
            raise ConfigError("--spec-lookup needs --draft")
        from engine.dflash.lookup import MAX_MIN_MATCH

        if not 0 <= spec_lookup <= MAX_MIN_MATCH:
            raise ConfigError(f"--spec-lookup must be 0 (off) .. {MAX_MIN_MATCH}, got {spec_lookup}")
    if weights not in ("dense", "quantized"):
        raise ConfigError(f"--weights must be dense or quantized, got {weights!r}")
    if cold_format not in ("dense", "quantized"):
        raise ConfigError(f"--cold-format must be dense or quantized, got {cold_format!r}")
    if cold_format != "dense" and expert_budget is None:
        raise ConfigError("--cold-format needs --expert-budget (without it every expert stays on the device)")
    if hot_format not in ("dense", "quantized"):
        raise ConfigError(f"--hot-format must be dense or quantized, got {hot_format!r}")
    if hot_format != "dense" and cold_format != "quantized":
        raise ConfigError("--hot-format quantized needs --cold-format quantized")
    if cold_device not in ("cpu", "gpu"):
        raise ConfigError(f"--cold-device must be cpu or gpu, got {cold_device!r}")
    if cold_device != "cpu" and expert_budget is None:
        raise ConfigError("--cold-device needs --expert-budget (without it every expert stays on the device)")
    if placement_unit is not None and expert_budget is None:
        raise ConfigError("--placement-unit needs --expert-budget (without it every expert stays on the device)")
    if (cold_prefetch is not None or cold_warm is not None) and not cold_cpu_share:
        raise ConfigError("--cold-prefetch and --cold-warm need --cold-cpu-share above 0 (the fetches ride the "
                          "share's second stream)")
    if cold_cpu_share is not None and cold_device != "gpu":
        raise ConfigError("--cold-cpu-share needs --cold-device gpu (with --cold-device cpu the threads compute "
                          "every cold expert)")
    eng = Engine.from_gguf(model, device=device, dtype=dtype, threads=threads,
                           expert_budget_mb=expert_budget, drafter=drafter, draft=draft, cold_format=cold_format,
                           weights=weights, cuda_graph=cuda_graph, hot_format=hot_format, cold_device=cold_device,
                           cold_cpu_share=cold_cpu_share, cold_cpu_int8=cold_cpu_int8 if cold_cpu_share else None,
                           placement_unit=placement_unit, cold_prefetch=cold_prefetch, cold_warm=cold_warm)
    ids = eng.tokenizer.encode(text)
    err = Console(stderr=True)
    if not as_json:
        err.print(f"[dim]{model.name}: {len(ids)} prompt tokens, loaded in {eng.load_s:.2f} s "
                  f"on {eng.device} ({str(eng.dtype).removeprefix('torch.')})[/dim]")

    def stream(_token: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = eng.generate(ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                          pflash_keep_ratio=keep_ratio, spec_len=spec_len, spec_fallback=fallback,
                          spec_lookup=spec_lookup, on_token=None if as_json else stream)
    if as_json:
        out = result.as_dict()
        out["load_s"] = eng.load_s
        print(json.dumps(out))
        return
    t = result.timings
    sys.stdout.write("\n")
    err.print(f"[dim]prefill {t.prompt_tokens} tok in {t.prefill_s * 1000:.1f} ms "
              f"({t.prompt_tokens / max(t.prefill_s, 1e-9):.1f} tok/s{_prefill_path(t.extra)}) | decode "
              f"{t.new_tokens} tok at {t.decode_tok_s:.1f} tok/s ({_decode_path(t.extra)}) | peak memory "
              f"{t.peak_mem_mb:.0f} MB | stop: {result.stop_reason}[/dim]")
    extra = t.extra
    if "prefill_graph_capture_s" in extra:
        err.print(f"[dim]prefill of {extra['prefill_padded_to']} tokens captured in a CUDA graph in "
                  f"{extra['prefill_graph_capture_s'] * 1000:.0f} ms (once per engine and padded length)[/dim]")
    if "decode_graph_capture_s" in extra:
        err.print(f"[dim]decode step captured in a CUDA graph in {extra['decode_graph_capture_s'] * 1000:.0f} ms "
                  "(once per engine and state size)[/dim]")
    if "hot_experts" in extra:
        err.print(f"[dim]experts hot/cold {extra['hot_experts']}/{extra['cold_experts']} | cold-hit rate "
                  f"{extra['cold_hit_rate']:.1%} (expected {extra['expected_cold_hit_rate']:.1%}) | "
                  f"expert memory {extra['expert_vram_mb']:.0f} MB (host {extra['expert_host_mb']:.0f} MB)[/dim]")
    if "acceptance_length" in extra:
        lookup = f", lookup {extra['lookup']}" if extra.get("lookup") else ""
        err.print(f"[dim]dflash spec_len {extra['spec_len']}{lookup} | acceptance length {extra['acceptance_length']:.2f} "
                  f"tokens per target forward | draft {extra['draft_s'] * 1000:.1f} ms, verify "
                  f"{extra['verify_s'] * 1000:.1f} ms, rollback {extra['rollback_s'] * 1000:.1f} ms | paths: draft "
                  f"{extra.get('draft_path', 'eager')}, verify {extra.get('verify_path', 'eager')}"
                  f"{_plain_stretches(extra)}[/dim]")
    if "pflash_kept_tokens" in extra:
        err.print(f"[dim]pflash kept {extra['pflash_kept_tokens']}/{extra['pflash_total_tokens']} tokens | "
                  f"drafter {extra['pflash_drafter_s'] * 1000:.1f} ms | target prefill "
                  f"{extra['pflash_target_prefill_s'] * 1000:.1f} ms[/dim]")


def _decode_path(extra: dict) -> str:
    """How the decode ran, for the timings line: DFlash's speculative loop, or plain decoding's path."""
    if "acceptance_length" in extra:
        return "dflash"
    return extra.get("decode_path", "eager")


def _prefill_path(extra: dict) -> str:
    """``, eager`` or ``, cuda_graph padded to N`` for the timings line (empty where a DFlash or PFlash
    prefill ran, which report their own)."""
    path = extra.get("prefill_path")
    if path is None:
        return ""
    return f", {path}" + (f" padded to {extra['prefill_padded_to']}" if "prefill_padded_to" in extra else "")


def _spec_fallback(text: str, draft: Path | None) -> float | str:
    """``--spec-fallback``'s value: ``auto`` or a non-negative number (checked before the model loads)."""
    if draft is None:
        raise ConfigError("--spec-fallback needs --draft")
    from engine.dflash.speculative import check_fallback

    try:
        value = text if text == "auto" else float(text)
        check_fallback(value)
    except ValueError:
        raise ConfigError(f"--spec-fallback must be >= 0 (0: no plain stretches) or auto, got {text!r}") from None
    return value


def _plain_stretches(extra: dict) -> str:
    """What the speculative loop's plain stretches did, for the timings line ('' when none ran)."""
    times = ""
    if extra.get("step_ms") and extra.get("plain_step_ms"):
        times = f" | step {extra['step_ms']:.2f} ms, plain step {extra['plain_step_ms']:.2f} ms"
    if not extra.get("fallback"):
        return times
    return (f" | plain stretches {extra.get('fallbacks', 1)}x ({extra.get('plain_steps', 0)} tokens, "
            f"{extra.get('plain_path', 'eager')}), first at token {extra.get('fallback_at')}{times}")


def _read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    if (prompt is None) == (prompt_file is None):
        raise ConfigError("give exactly one of --prompt and --prompt-file")
    if prompt_file is not None:
        try:
            return prompt_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read prompt file {prompt_file}: {exc.strerror}") from None
    return prompt


def inspect(path: Path = typer.Argument(..., help="GGUF file")) -> None:
    """Print architecture, hyperparameters, tensor counts and bytes by quant type."""
    from engine.gguf.inspect import render, summarize

    Console().print(render(summarize(path)))


def make_model(
    out: Path = typer.Option(..., "--out", "-o", help="GGUF file to write"),
    preset: str = typer.Option("tiny", "--preset", help="tiny or qwen3.6-35b-a3b"),
    n_layers: Optional[int] = typer.Option(None, "--layers"),
    n_expert: Optional[int] = typer.Option(None, "--experts"),
    quant: str = typer.Option("f32", "--quant", help="f32 f16 bf16 q8_0 q4_0 q4_k q5_k q6_k"),
    expert_quant: Optional[str] = typer.Option(None, "--expert-quant"),
    seed: int = typer.Option(0, "--seed"),
    fused_experts: bool = typer.Option(False, "--fused-experts"),
    router_skew: float = typer.Option(0.0, "--router-skew"),
) -> None:
    """Write a random-weight qwen35moe GGUF of a named preset's shapes."""
    from rich.progress import Progress

    from engine.gguf.make_model import make_model as write

    with Progress(transient=True) as progress:
        task = progress.add_task(f"writing {out.name}", total=None)

        def report(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        path = write(out, preset, n_layers=n_layers, n_expert=n_expert, quant=quant,
                     expert_quant=expert_quant, seed=seed, fused_experts=fused_experts,
                     router_skew=router_skew, progress=report)
    Console().print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


def convert(
    hf_dir: Path = typer.Argument(..., help="HF Qwen3_5MoeForCausalLM checkpoint directory"),
    out: Path = typer.Option(..., "--out", "-o"),
    quant: str = typer.Option("f32", "--quant"),
) -> None:
    """Convert a HF qwen3_5_moe checkpoint to a qwen35moe GGUF (llama.cpp's conventions)."""
    from engine.gguf.convert_hf import convert_hf

    path = convert_hf(hf_dir, out, quant=quant)
    Console().print(f"wrote {path}")


def calibrate(
    model: Path = typer.Option(..., "--model", "-m", help="qwen35moe GGUF file"),
    text: list[Path] = typer.Option(..., "--text", help="text file(s) to route through the model"),
    window: int = typer.Option(512, "--window", help="tokens per calibration prompt"),
    max_prompts: int = typer.Option(64, "--max-prompts"),
    out: Optional[Path] = typer.Option(None, "--out", help="default: beside the model, <model>.routing.json"),
    device: str = typer.Option("auto", "--device"),
) -> None:
    """Count how often each (layer, expert) is routed to over real text: hybrid placement's input."""
    from rich.progress import Progress

    from engine.engine import Engine
    from engine.placement import calibrate_routing

    if window < 1 or max_prompts < 1:
        raise ConfigError("--window and --max-prompts must be at least 1")
    eng = Engine.from_gguf(model, device=device)
    ids: list[int] = []
    for f in text:
        try:
            ids += eng.tokenizer.encode(f.read_text(encoding="utf-8", errors="replace"))
        except OSError as exc:
            raise ConfigError(f"cannot read calibration text {f}: {exc.strerror}") from None
    prompts = [ids[i:i + window] for i in range(0, len(ids), window)][:max_prompts]
    if not prompts:
        raise ConfigError("the calibration text is empty")
    with Progress(transient=True) as progress:
        task = progress.add_task("calibrating", total=len(prompts))
        stats = calibrate_routing(eng.model, prompts,
                                  progress=lambda done, total: progress.update(task, completed=done))
    path = stats.save(model, out)
    Console().print(f"routing statistics of {len(prompts)} prompts ({sum(map(len, prompts))} tokens) -> {path}")
