"""Writers: the HuggingFace output (sharded safetensors, index, config, tokenizer files, journal) and the
destination it is published to (what ``force`` may replace, staging, the lock, the renames)."""
