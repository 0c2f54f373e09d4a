"""Training of the shipped qwen35moe family: corpus, tokenizer, models, export."""
