"""cagrpo_ray: RLVR with CA-GRPO on Ray, vLLM and DeepSpeed."""
