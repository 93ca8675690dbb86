"""Conversational training rows: the three common row shapes, rendered with a chat template, with the mask of
the assistant's tokens.

Row shapes (JSONL lines, parquet rows, hub dataset rows), detected by their keys:

* ``messages: [{"role": ..., "content": ...}, ...]`` (OpenAI / transformers chat format);
* ``conversations: [{"from": ..., "value": ...}, ...]`` (ShareGPT; ``human`` -> user, ``gpt`` -> assistant);
* ``prompt`` + ``response`` (also ``instruction`` / ``output``), with an optional ``system``.

A conversation is rendered with ``tokenizer.apply_chat_template`` (the base model's template, or a recipe's
``chat_template``), and tokenized exactly as ``apply_chat_template(..., tokenize=True)`` tokenizes it. The
assistant mask marks the tokens of each assistant turn as the template writes it: the text between the render of
the turns before it with the generation prompt and the render that includes it (the content plus the template's
end-of-turn marker, e.g. ``Paris.<|im_end|>\\n`` for ChatML). This is what transformers'
``return_assistant_tokens_mask`` marks for a template whose ``{% generation %}`` block spans the same text,
without needing that block in the template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
                "bot": "assistant", "model": "assistant", "chatgpt": "assistant", "tool": "tool"}
ROW_SHAPES = "'messages' [{role, content}], 'conversations' [{from, value}] (ShareGPT) or 'prompt' + 'response'"


def conversation_from_row(row: Any, where: str) -> list[dict[str, str]] | None:
    """The conversation of a data row as ``[{"role", "content"}]``, or None when the row has no conversation key.

    Args:
        row: a parsed JSON object / dataset row. where: ``file:line`` (or dataset and index) for messages.

    Raises:
        ValueError: a conversation key with a malformed value (where, the turn and what was expected named).
    """
    if not isinstance(row, dict):
        return None
    if "messages" in row or "conversations" in row:
        key = "messages" if "messages" in row else "conversations"
        turns = row[key]
        role_key, text_key = ("role", "content") if key == "messages" else ("from", "value")
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: {key!r} must be a non-empty list of turns, got {type(turns).__name__}")
        out = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict) or role_key not in t or text_key not in t:
                raise ValueError(f"{where}: {key}[{i}] must be an object with {role_key!r} and {text_key!r}, got "
                                 f"{t!r:.80}")
            role = ROLE_ALIASES.get(str(t[role_key]).lower())
            if role is None:
                raise ValueError(f"{where}: {key}[{i}] has role {t[role_key]!r}; expected one of "
                                 f"{sorted(set(ROLE_ALIASES))}")
            if not isinstance(t[text_key], str):
                raise ValueError(f"{where}: {key}[{i}].{text_key} must be a string, got {type(t[text_key]).__name__}")
            out.append({"role": role, "content": t[text_key]})
        return out
    for p_key, r_key in (("prompt", "response"), ("instruction", "output")):
        if p_key in row and r_key in row:
            if not isinstance(row[p_key], str) or not isinstance(row[r_key], str):
                raise ValueError(f"{where}: {p_key!r} and {r_key!r} must be strings")
            system = [{"role": "system", "content": row["system"]}] if isinstance(row.get("system"), str) else []
            return system + [{"role": "user", "content": row[p_key]}, {"role": "assistant", "content": row[r_key]}]
    return None


@dataclass
class RenderedChat:
    """A rendered conversation: ``text``, its token ``ids`` and ``assistant_mask`` (one bool per token)."""

    text: str
    ids: list[int]
    assistant_mask: list[bool]


def _render(tokenizer, messages, template, **kw) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, chat_template=template, **kw)


def render_conversation(tokenizer, messages: list[dict[str, str]], chat_template: str | None = None,
                        where: str = "conversation") -> RenderedChat:
    """Render and tokenize a conversation; mark the assistant turns' tokens (module docstring).

    Raises:
        ValueError: no chat template (neither the tokenizer's nor ``chat_template``), or a template whose render
            of a conversation does not start with its render of the earlier turns (the assistant spans cannot
            then be located), with ``where`` named.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"{where}: conversational data needs a chat template, and the tokenizer has none; use a "
                         f"chat (instruct) base model or give the recipe a chat_template")
    text = _render(tokenizer, messages, template)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], template, add_generation_prompt=True) if k else ""
        upto = _render(tokenizer, messages[:k + 1], template)
        if not (text.startswith(upto) and upto.startswith(before)):
            raise ValueError(f"{where}: the chat template renders turn {k} differently once later turns follow "
                             f"(it rewrites earlier turns), so the assistant tokens cannot be located; give the "
                             f"recipe a chat_template that only appends")
        spans.append((len(before), len(upto)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    mask = [any(a < e and b > s for s, e in spans) for a, b in enc["offset_mapping"]]
    return RenderedChat(text=text, ids=list(enc["input_ids"]), assistant_mask=mask)


def conversation_text(messages: list[dict[str, str]]) -> str:
    """The turns' contents joined by newlines (what decontamination compares)."""
    return "\n".join(m["content"] for m in messages)
