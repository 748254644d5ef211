"""Character-level tokenizer for the small local policies.

One token per byte and no merges: every ASCII character is one token, and any text (other
UTF-8 characters take one token per byte) encodes without an unknown token, so reasoning_gym's
English questions can be fed as they are. The R1 tags `<think>`, `</think>`, `<answer>`,
`</answer>` are single tokens: `<think>98+93=191</think><answer>191</answer>` is 17 tokens.
The tags are added as *non-special* tokens, because vLLM and `decode(skip_special_tokens=True)`
drop special tokens from the text, and the format verifier needs the tags in the text.

Why byte-level pieces rather than a WordLevel model over characters: transformers 5.19's
`AutoTokenizer` loads any directory whose config says `model_type: qwen2` as `Qwen2Tokenizer`,
which rebuilds its own pipeline (GPT-2 regex split, byte-level pre-tokenizer, BPE) from the saved
vocabulary and ignores a saved WordLevel pipeline; a WordLevel vocabulary then loses every space.
So the tokenizer is built as that same pipeline with a 256-symbol byte alphabet and no merges,
and loads identically here, through `AutoTokenizer` and in vLLM.

The chat template renders user and assistant turns only and leaves system messages out: the
small policies are trained without the R1 instruction, since a constant sentence of about 250
characters would carry no information about the problem and would multiply the sequence length
(and the training cost) several times. Response structure is taught by the warm start instead.
"""

from __future__ import annotations

from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, USER, ASSISTANT)
R1_TAGS = ("<think>", "</think>", "<answer>", "</answer>")

CHAT_TEMPLATE = (
    "{#- System messages are left out on purpose: this policy was trained without an"
    " instruction (see cagrpo_ray/policies/tokenizer.py). -#}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<|user|>' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|assistant|>' + message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def byte_symbols() -> list[str]:
    """The 256 printable stand-ins of the byte-level pre-tokenizer, in byte order (GPT-2's map).

    Printable ASCII bytes stand for themselves; e.g. space is 'Ġ' and newline 'Ċ'.
    """
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    symbols, shifted = {}, 0
    for byte in range(256):
        if byte in kept:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + shifted)
            shifted += 1
    return [symbols[byte] for byte in range(256)]


def char_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer: 5 special tokens, 256 bytes, 4 R1 tags (265 ids).

    Ids are fixed by construction: pad=0, bos=1, eos=2, `<|user|>`=3, `<|assistant|>`=4,
    byte b is 5 + b, and the tags follow at 261..264; every small policy shares this vocabulary.
    """
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *byte_symbols(), *R1_TAGS))}
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[USER, ASSISTANT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in R1_TAGS])
    return tokenizer
