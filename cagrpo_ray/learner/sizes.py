"""Sizes the learner gives DeepSpeed, in a module that imports nothing, so that the memory
planner (`plan/memory.py`) reads the same numbers without importing DeepSpeed."""

# ZeRO's reduce and all-gather buckets, in elements (`distributed.deepspeed_config`)
REDUCE_BUCKET_ELEMENTS = 500_000_000
