"""DFlash speculative decoding for qwen35moe: draft model, draft files, compatibility check,
the speculative loop with state rollback, and draft training."""
