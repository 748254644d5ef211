"""Per-step metrics: JSONL log, end-of-run plots and summary."""
