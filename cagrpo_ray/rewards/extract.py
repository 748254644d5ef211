"""Pull the final answer or the code out of a response.

Every function here runs in time linear in the response length (string searches and one pass
over the braces, no backtracking patterns), so a megabyte of unterminated tags or braces costs
milliseconds, not the verifier's whole time budget.
"""

from __future__ import annotations

import re


def extract_tagged(text: str, tag: str = "answer") -> str | None:
    """Content of the last complete `<tag>...</tag>` in `text`, stripped; None if there is none.

    "Last complete" means: the last closing tag, and the nearest opening tag before it, so
    `<answer>1</answer> <answer>2</answer>` gives "2" and an unterminated `<answer>3` is ignored.
    """
    opening, closing = f"<{tag}>", f"</{tag}>"
    end = text.rfind(closing)
    if end < 0:
        return None
    start = text.rfind(opening, 0, end)
    if start < 0:
        return None
    return text[start + len(opening) : end].strip()


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, with nested braces.

    `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`; a box whose braces never close is skipped in
    favour of the previous one; None if no box closes.
    """
    starts = [m.end() - 1 for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    closing = _matching_braces(text)
    for open_brace in reversed(starts):
        if open_brace in closing:
            return text[open_brace + 1 : closing[open_brace]].strip()
    return None


def extract_final_answer(text: str) -> str | None:
    """The response's final answer: the answer tag's content, a box inside it or in the text.

    Order: a `\\boxed{}` inside the last answer tag, else the answer tag's content, else the last
    `\\boxed{}` anywhere. None when the response commits to no answer.
    """
    tagged = extract_tagged(text, "answer")
    if tagged is not None:
        boxed = extract_boxed(tagged)
        return boxed if boxed is not None else tagged
    return extract_boxed(text)


def strip_trailing_special_tokens(text: str) -> str:
    """`text` stripped, without the special tokens an engine left at its end (`</s>`,
    `<|im_end|>`, ...)."""
    text = text.strip()
    while True:
        if text.endswith(("</s>", "<eos>", "<pad>")):
            text = text[: text.rfind("<")].rstrip()
        elif text.endswith("|>") and "<|" in text[-64:]:
            text = text[: text.rfind("<|")].rstrip()
        else:
            return text


def extract_code(text: str) -> str | None:
    """Python source from a response: the last fenced block, searched in the answer tag first.

    Fences tagged `python`, `py`, `python3` or untagged count; a block in another language does
    not. Without any fence, the answer tag's content is taken as the code. None otherwise.
    """
    tagged = extract_tagged(text, "answer")
    for scope in (tagged, text):
        if scope is not None:
            block = _last_python_block(scope)
            if block is not None:
                return block
    return tagged if tagged else None


def _matching_braces(text: str) -> dict[int, int]:
    """Position of each unescaped `{` that closes -> position of its `}` (one pass)."""
    stack: list[int] = []
    closing: dict[int, int] = {}
    for match in re.finditer(r"(?<!\\)[{}]", text):
        if match.group() == "{":
            stack.append(match.start())
        elif stack:
            closing[stack.pop()] = match.start()
    return closing


def _last_python_block(text: str) -> str | None:
    fences = _find_all(text, "```")
    # Fences pair up from the start: 0 opens, 1 closes, 2 opens, ...
    for open_fence, close_fence in reversed(list(zip(fences[0::2], fences[1::2], strict=False))):
        header, _, body = text[open_fence + 3 : close_fence].partition("\n")
        if header.strip().lower() in ("python", "py", "python3", ""):
            return body
    return None


def _find_all(text: str, needle: str) -> list[int]:
    positions, start = [], text.find(needle)
    while start >= 0:
        positions.append(start)
        start = text.find(needle, start + len(needle))
    return positions


# A number as a model writes it: an optional sign (ASCII or Unicode minus), digits with optional
# thousands separators, an optional decimal part. Linear: no nested quantifiers.
_NUMBER = re.compile(r"[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_MARKER = re.compile(r"(?i)\b(?:final answer|answer)\b(?:\s+is)?\s*[:=]?")
# After a bare "answer" (no "is", ":" or "="): the words up to an "is" on its line, bounded so
# that a long line of bare markers stays linear. "The answer to 3 + 4 is 7" -> " 7".
_LATER_IS = re.compile(r"(?i)[^\n:=]{0,100}?\bis\b\s*[:=]?")


def is_number(text: str) -> bool:
    """Whether `text` is one number as `_NUMBER` reads it ("-1,000.5", "42", "−3")."""
    return _NUMBER.fullmatch(text.strip()) is not None


def normalize_number(text: str) -> str:
    """`-1,000.50` -> `-1000.5`, `42.0` -> `42`, Unicode minus -> `-`: one spelling a number."""
    text = text.replace("−", "-").replace(",", "")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def extract_answer_text(text: str) -> tuple[str | None, str | None]:
    """(final answer, how it was found) in free text written by a pretrained model.

    In order: the last `<answer>` tag ("tag"), the last `\\boxed{}` ("boxed"), the text after
    the last "Answer:" / "answer is" / "final answer" on its line ("marker"; after a bare
    "answer", what follows a later "is" on the line, as in "The answer to 3 + 4 is 7.", and a
    bare one with neither that nor a number after it is a mention, not an answer), else the last
    number in the response ("last_number", the flexible fallback of lm-eval's GSM8K). A tag,
    box or marker whose content holds a number gives that number (the last one after any "=",
    normalised: "Answer: 1,234 apples." gives "1234"); one without a number gives its text
    without trailing punctuation. (None, None) when the response has none of these.
    """
    text = strip_trailing_special_tokens(text)
    segment, how = extract_tagged(text, "answer"), "tag"
    if segment is not None:
        segment = extract_boxed(segment) or segment
    else:
        segment, how = extract_boxed(text), "boxed"
    if segment is None:
        markers = list(_MARKER.finditer(text))
        if markers:
            rest = text[markers[-1].end() :]
            segment, how = rest.split("\n", 1)[0] if rest.strip("\n") else rest, "marker"
            if not segment.strip() and rest.strip():  # "Answer:\n42"
                segment = rest.strip().split("\n", 1)[0]
            if markers[-1].group().rstrip().lower().endswith("answer"):
                segment = _bare_marker_segment(segment)
    if segment is not None:
        after_equals = segment.rsplit("=", 1)[-1]
        numbers = _NUMBER.findall(after_equals) or _NUMBER.findall(segment)
        if numbers:
            return normalize_number(numbers[0] if after_equals.strip() else numbers[-1]), how
        cleaned = segment.strip().rstrip(".!,;:").strip()
        if cleaned:
            return cleaned, how
    numbers = _NUMBER.findall(text)
    if numbers:
        return normalize_number(numbers[-1]), "last_number"
    return None, None


def _bare_marker_segment(segment: str) -> str | None:
    """What a bare "answer" (not followed by "is", ":" or "=") introduces: the text after a
    later "is" ("The answer to 3 + 4 is 7."); else the segment if it holds a number ("The final
    answer 42"); else None, a mention that gives no answer ("This is the final answer to the
    problem.")."""
    later = _LATER_IS.match(segment)
    after = segment[later.end() :] if later else None
    if after is not None and (_NUMBER.search(after) or not _NUMBER.search(segment)):
        return after
    return segment if _NUMBER.search(segment) else None
