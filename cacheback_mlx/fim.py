"""Fill-in-the-middle prompts from a model's FIM tokens (prefix-suffix-middle order).

llama.cpp's /infill layout: extra context chunks (other files) first, then
<prefix>PREFIX<suffix>SUFFIX<middle>PROMPT, where PROMPT is the text typed on the cursor line.
With repo-level tokens, each chunk is introduced by the file separator and its file name.
"""

from __future__ import annotations

from .errors import CachebackError


def fim_prompt(fim: dict | None, prefix: str, suffix: str, extra: list[dict] | None = None, prompt: str = "") -> str:
    if not fim:
        raise CachebackError("this model has no fill-in-the-middle tokens; use a code model with FIM "
                             "(e.g. --model qwen2.5-coder-0.5b) for infill")
    parts = []
    for chunk in extra or []:
        text = chunk.get("text", "")
        if fim.get("file_sep"):
            parts.append(f"{fim['file_sep']}{chunk.get('filename', '')}\n{text}")
        else:
            parts.append(text)
    parts.append(f"{fim['prefix']}{prefix}{fim['suffix']}{suffix}{fim['middle']}{prompt}")
    return "".join(parts)
