"""``hylo-bench generate``: one prompt through any model argument (HyLo hybrid or plain transformers), streamed.

Greedy decoding when ``temperature == 0`` (the default), otherwise sampling with temperature / top-p / top-k
through ``model.generate``. The text is streamed while tokens arrive (``transformers.TextStreamer``), optionally
with ``<think>`` spans removed on the fly (:class:`hylo_bench.text.think.ThinkStripper`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import TextStreamer

from hylo_bench.config.device import parse_dtype
from hylo_bench.text.think import THINK_CLOSE, THINK_OPEN, ThinkStripper, strip_think

logger = logging.getLogger(__name__)

@dataclasses.dataclass(kw_only=True, slots=True)
class GenerateConfig:
    """One ``generate`` call.

    Attributes:
        model: hub id, local checkpoint directory (HyLo or plain transformers) or ``demo``.
        prompt: the prompt text (the user turn with ``chat``).
        chat: render the prompt with the tokenizer's chat template (user turn + generation prompt).
        max_new_tokens: most tokens to generate (stops earlier at EOS).
        temperature: 0 = greedy; > 0 samples with this temperature.
        top_p: nucleus sampling mass in (0, 1]; None = off. Only with temperature > 0.
        top_k: keep the k most likely tokens (>= 1); None = off. Only with temperature > 0.
        seed: torch seed set before generating (sampling reproducibility).
        strip_think: remove ``<think>...</think>`` spans from the output (streamed and returned).
        device: ``cpu`` / ``cuda`` (default: cuda when available).
        dtype: parameter dtype name (default: bf16 on GPU, fp32 on CPU); see
            :func:`hylo_bench.config.device.parse_dtype`.
    """

    model: str
    prompt: str
    chat: bool = False
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    strip_think: bool = False
    device: str | None = None
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        parse_dtype(self.dtype)


@dataclasses.dataclass(kw_only=True, slots=True)
class GenerateResult:
    """What :func:`generate_text` produced.

    Attributes:
        text: the decoded new tokens (special tokens skipped; ``<think>`` spans removed with ``strip_think``).
        token_ids: the new token ids, EOS included when generation stopped there.
        prompt_tokens: number of prompt tokens.
    """

    text: str
    token_ids: list[int]
    prompt_tokens: int


def render_prompt(tokenizer: Any, prompt: str, chat: bool, model_name: str) -> tuple[str, list[int]]:
    """(prompt text as the model sees it, its token ids).

    Without ``chat`` the tokenizer adds its special tokens (e.g. BOS); with ``chat`` the template provides them.

    Raises:
        ValueError: ``chat`` with a tokenizer that has no chat template (the checkpoint is named).
    """
    if not chat:
        return prompt, list(tokenizer(prompt).input_ids)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{model_name}: the tokenizer has no chat template (no 'chat_template' in "
                         f"tokenizer_config.json and no chat_template.jinja); drop --chat to send the raw prompt")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return text, list(tokenizer(text, add_special_tokens=False).input_ids)


def _opens_think(prompt_text: str) -> bool:
    """True when the prompt ends inside a ``<think>`` span (a template that starts the model thinking)."""
    return prompt_text.rfind(THINK_OPEN) > prompt_text.rfind(THINK_CLOSE)


def _generation_kwargs(model: Any, tokenizer: Any, cfg: GenerateConfig) -> dict:
    gc = copy.deepcopy(model.generation_config)
    gc.max_new_tokens = cfg.max_new_tokens
    gc.max_length = None
    if gc.eos_token_id is None:
        gc.eos_token_id = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else gc.eos_token_id
    gc.pad_token_id = pad[0] if isinstance(pad, (list, tuple)) else pad
    if cfg.temperature == 0:
        if cfg.top_p is not None or cfg.top_k is not None:
            logger.warning("--top-p / --top-k are ignored with --temperature 0 (greedy decoding)")
        gc.do_sample, gc.temperature, gc.top_p, gc.top_k = False, None, None, None
    else:
        gc.do_sample, gc.temperature, gc.top_p, gc.top_k = True, cfg.temperature, cfg.top_p or 1.0, cfg.top_k or 0
    return {"generation_config": gc}


class _CallbackStreamer(TextStreamer):
    """``TextStreamer`` that hands finalized text (optionally think-stripped) to a callback, not to stdout."""

    def __init__(self, tokenizer: Any, on_text: Callable[[str], None], stripper: ThinkStripper | None) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self._on_text, self._stripper = on_text, stripper

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if self._stripper is not None:
            text = self._stripper.feed(text) + (self._stripper.flush() if stream_end else "")
        if text:
            self._on_text(text)


def generate_text(model: Any, tokenizer: Any, cfg: GenerateConfig, *, model_name: str | None = None,
                  on_text: Callable[[str], None] | None = None) -> GenerateResult:
    """Generate one continuation of ``cfg.prompt`` with a loaded model, streaming text to ``on_text``.

    Args:
        model: a causal LM with ``generate`` (``HyLoForCausalLM`` or a transformers model), in eval mode.
        tokenizer: its tokenizer.
        cfg: prompt and decoding options (``cfg.model`` / ``device`` / ``dtype`` are not used here).
        model_name: used in error messages (default ``cfg.model``).
        on_text: called with each new piece of text as it is finalized; the pieces concatenate to
            ``result.text`` (up to where the streamer breaks words).

    Raises:
        ValueError: ``cfg.chat`` with a tokenizer without a chat template.
    """
    prompt_text, ids = render_prompt(tokenizer, cfg.prompt, cfg.chat, model_name or cfg.model)
    stripper = ThinkStripper(start_inside=_opens_think(prompt_text)) if cfg.strip_think else None
    streamer = _CallbackStreamer(tokenizer, on_text, stripper) if on_text is not None else None
    device = next(model.parameters()).device
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    torch.manual_seed(cfg.seed)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                             **_generation_kwargs(model, tokenizer, cfg))
    new_ids = out[0, len(ids):].tolist()
    text = tokenizer.decode(new_ids, skip_special_tokens=True)
    if cfg.strip_think:
        text = strip_think(THINK_OPEN + text) if _opens_think(prompt_text) else strip_think(text)
    return GenerateResult(text=text, token_ids=new_ids, prompt_tokens=len(ids))


def run(cfg: GenerateConfig, *, on_text: Callable[[str], None] | None = None) -> tuple[GenerateResult, dict]:
    """Load ``cfg.model`` with :func:`hylo_bench.models.loading.load_model` and run :func:`generate_text`.

    Returns:
        (the result, the loader's info dict: ``name``, ``path``, ``hash``, ``layout``, ``kind``).

    Raises:
        FileNotFoundError / ValueError: from loading (checkpoint named) or from :func:`generate_text`.
    """
    from hylo_bench.models.loading import load_model

    model, tokenizer, info = load_model(cfg.model, device=cfg.device, dtype=parse_dtype(cfg.dtype))
    return generate_text(model, tokenizer, cfg, model_name=info["name"], on_text=on_text), info
