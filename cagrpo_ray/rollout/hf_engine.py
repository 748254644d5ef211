"""The fallback engine: transformers `generate`, with the same outputs as the vLLM engine.

Prompts of a batch are left-padded (transformers derives each row's position ids from its
attention mask). Behavior log-probs are the log-softmax of `generate`'s processed scores,
i.e. of the logits after temperature scaling and the top-k / top-p filters: the same
distribution vLLM's "processed_logprobs" describe, and log_softmax(logits) when greedy.

With a LoRA adapter (`lora`) the model is wrapped with PEFT (`get_peft_model`, the adapter as
the learner builds it, dropout off in eval mode) and a sync brings the adapter's PEFT-named
tensors only (`policies/lora.py`): all of them are staged, checked to be exactly the adapter's
(none missing, none unknown), and only then loaded with `set_peft_model_state_dict`, which
inserts PEFT's adapter name ("default") into each name. The sync is acknowledged with the
checksum of `get_peft_model_state_dict` read back from the model afterwards: the adapter as it
now sits in the layers that `generate` runs, under the sender's names.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from cagrpo_ray.policies.lora import ADAPTER_NAME, LoraSpec, adapter_checksum
from cagrpo_ray.sync import SyncAddress, WeightReceiver
from cagrpo_ray.types import Completion, SamplingConfig


class HFEngine:
    """`AutoModelForCausalLM.generate` behind the engine protocol (one weight-sync rank).

    Sampling draws from the engine's own RNG stream (seeded with `seed`) unless the request
    carries a seed, and leaves the process-wide torch RNG untouched. At most `max_batch_rows`
    sequences go through one `generate` call.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        seed: int = 0,
        max_model_len: int = 1024,
        dtype: str = "auto",
        device: str | None = None,
        max_batch_rows: int = 256,
        lora: LoraSpec | None = None,
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
        self.lora = lora
        if lora is not None:
            import peft

            self.model = peft.get_peft_model(self.model, lora.peft_config())
        self.model.to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model_path = str(model_path)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, list) else [eos])
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids)
        self.max_model_len = max_model_len
        self.max_batch_rows = max_batch_rows
        self.policy_version = 0
        self.num_sync_ranks = 1
        self._rng_state = _seeded_rng_state(seed, self.device)
        self._receiver: WeightReceiver | None = None

    def _stop_string_end(self, tokens: list[int], stop: tuple[str, ...]) -> int | None:
        """The token count up to the token that completes the first of `stop`, or None."""
        if not stop:
            return None
        for end in range(1, len(tokens) + 1):
            text = self.tokenizer.decode(tokens[:end], skip_special_tokens=False)
            if any(s in text for s in stop):
                return end
        return None

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        for index, prompt in enumerate(prompts):
            if len(prompt) >= self.max_model_len:
                raise ValueError(
                    f"prompt {index} has {len(prompt)} tokens; max_model_len is "
                    f"{self.max_model_len}, which leaves no room for a completion"
                )
        rows = [list(prompt) for prompt in prompts for _ in range(sampling.n)]
        completions: list[Completion] = []
        for chunk, start in enumerate(range(0, len(rows), self.max_batch_rows)):
            seed = None if sampling.seed is None else sampling.seed + chunk
            completions += self._generate_rows(
                rows[start : start + self.max_batch_rows], sampling, seed
            )
        n = sampling.n
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate_rows(
        self, rows: list[list[int]], sampling: SamplingConfig, seed: int | None
    ) -> list[Completion]:
        from transformers import GenerationConfig

        width = max(len(row) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row) :] = torch.tensor(row)
            attention_mask[i, width - len(row) :] = 1
        steps = min(sampling.max_tokens, self.max_model_len - min(len(row) for row in rows))
        config = GenerationConfig(
            max_new_tokens=steps,
            eos_token_id=sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_scores=True,
        )
        if sampling.greedy:
            config.do_sample, config.top_k = False, None  # no sampling flags: no warnings
        else:
            config.do_sample = True
            config.temperature = sampling.temperature
            config.top_k = sampling.top_k  # 0 disables, as in SamplingConfig
            config.top_p = sampling.top_p
        with torch.random.fork_rng(devices=_cuda_devices(self.device)):
            if seed is None:
                _set_rng_state(self._rng_state, self.device)
            else:
                torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=config,
            )
            if seed is None:
                self._rng_state = _get_rng_state(self.device)
        sampled = out.sequences[:, width:]  # [rows, steps]
        logprobs = torch.stack(  # log p of each sampled token under the processed scores
            [
                step.float().log_softmax(-1).gather(-1, sampled[:, t : t + 1]).squeeze(-1)
                for t, step in enumerate(out.scores)
            ],
            dim=1,
        )
        return [
            self._completion(row, sampled[i].tolist(), logprobs[i].tolist(), sampling)
            for i, row in enumerate(rows)
        ]

    def _completion(
        self, prompt: list[int], tokens: list[int], logprobs: list[float], sampling
    ) -> Completion:
        budget = min(sampling.max_tokens, self.max_model_len - len(prompt))
        stop = next((t for t, token in enumerate(tokens) if token in self.eos_token_ids), None)
        if stop is not None and stop < budget:
            tokens, logprobs, finish = tokens[: stop + 1], logprobs[: stop + 1], "stop"
            shown = tokens[:-1]  # as vLLM, the stop token is not in the text
        else:
            tokens, logprobs, finish = tokens[:budget], logprobs[:budget], "length"
            shown = tokens
        cut = self._stop_string_end(shown, sampling.stop)
        if cut is not None:  # as if sampling had stopped there: later tokens never existed
            tokens, logprobs, finish = tokens[:cut], logprobs[:cut], "stop"
            shown = tokens
        return Completion(
            prompt_token_ids=prompt,
            token_ids=tokens,
            logprobs=logprobs,
            text=self.tokenizer.decode(shown, skip_special_tokens=False),
            finish_reason=finish,
            policy_version=self.policy_version,
        )

    @torch.no_grad()
    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Full tensors with Hugging Face names; with a LoRA adapter, the adapter's tensors
        with PEFT's names (`policies/lora.py`), all of them."""
        if self.lora is not None:
            self._load_adapter(named_tensors)
            if version is not None:
                self.policy_version = version
            return
        targets = self.model.state_dict(keep_vars=True)  # tied names included
        for name, tensor in named_tensors:
            if name not in targets:
                raise KeyError(f"HF engine: the model has no parameter or buffer {name!r}")
            targets[name].copy_(tensor)
        if version is not None:
            self.policy_version = version

    def init_weight_sync(self, address: SyncAddress | dict, rank_offset: int) -> list[int]:
        if self._receiver is not None:  # a rebuilt group: release the old one's transport
            self._receiver.close()
            self._receiver = None
        self._receiver = WeightReceiver(address, rank_offset)
        return [rank_offset]

    def receive_weights(self, version: int) -> dict:
        if self._receiver is None:
            raise RuntimeError(f"HF engine: receive_weights({version}) before init_weight_sync")
        stats = self._receiver.receive(version, self.load_weights)
        self.policy_version = version
        result = {"version": version, "num_bytes": stats.num_bytes, "seconds": stats.seconds}
        if self.lora is not None:
            result["adapter_checksum"] = self.served_adapter_checksum()
        return result

    def _load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stage every adapter tensor, check the names, then load them all (module docstring)."""
        import peft

        staged = {name: tensor.clone() for name, tensor in named_tensors}
        expected = set(peft.get_peft_model_state_dict(self.model, adapter_name=ADAPTER_NAME))
        missing, unknown = sorted(expected - set(staged)), sorted(set(staged) - expected)
        if missing or unknown:
            raise ValueError(
                f"HF engine: the adapter sent is not this engine's adapter: missing "
                f"{missing[:5]} ({len(missing)}), unknown {unknown[:5]} ({len(unknown)})"
            )
        result = peft.set_peft_model_state_dict(self.model, staged, adapter_name=ADAPTER_NAME)
        if result.unexpected_keys:  # names that set_peft_model_state_dict mapped wrong
            raise ValueError(f"HF engine: PEFT did not load {sorted(result.unexpected_keys)[:5]}")

    def served_adapter_checksum(self) -> str:
        """`adapter_checksum` of the adapter in the model's layers, by the sender's names."""
        import peft

        state = peft.get_peft_model_state_dict(self.model, adapter_name=ADAPTER_NAME)
        return adapter_checksum(state.items())

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()


def _cuda_devices(device: torch.device) -> list[int]:
    return [device.index or 0] if device.type == "cuda" else []


def _seeded_rng_state(seed: int, device: torch.device):
    with torch.random.fork_rng(devices=_cuda_devices(device)):
        torch.manual_seed(seed)
        return _get_rng_state(device)


def _get_rng_state(device: torch.device):
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state, device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
