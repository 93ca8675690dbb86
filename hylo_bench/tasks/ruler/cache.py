"""RULER sample cache: JSONL files of generated samples keyed by (task, length, tokenizer hash, seed, haystack).

Samples are independent per index (:func:`hylo_bench.tasks.ruler.sampling.sample_seed`), so a cache holding
fewer samples than asked is extended in place and a larger one is read as a prefix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

from hylo_bench.io_utils import atomic_write_text
from hylo_bench.tasks.provenance import text_hash, tokenizer_hash
from hylo_bench.tasks.ruler.qa import QA_SOURCES, load_qa
from hylo_bench.tasks.ruler.sampling import generate_sample

GENERATOR_VERSION = 3
"""Bump when generation changes, so stale caches are not reused (2: flavors, QA tasks; 3: nvidia flavor as
NVIDIA/RULER: CWE example space and Random(42) list order, FWE vocabulary, chat prefix space, BOS-free sizing)."""


def cache_path(
    cache_dir: str | Path, task: str, length_tokens: int, tok_hash: str, seed: int, hay_hash: str, chat: bool,
    flavor: str = "nvidia",
) -> Path:
    """``<cache_dir>/<task>-<L>-<flavor>-tok<12 hex>-seed<seed>-hay<8 hex>[-chat]-v<GENERATOR_VERSION>.jsonl``.

    ``hay_hash`` is the essay text's hash, or for QA tasks the data file's sha256."""
    chat_tag = "-chat" if chat else ""
    name = (f"{task}-{length_tokens}-{flavor}-tok{tok_hash[:12]}-seed{seed}-hay{hay_hash[:8]}{chat_tag}"
            f"-v{GENERATOR_VERSION}")
    return Path(cache_dir) / f"{name}.jsonl"


def read_samples(path: Path) -> list[dict]:
    """Samples of a cache file, in index order; reading stops at the first unreadable or out-of-order line."""
    samples: list[dict] = []
    if not path.is_file():
        return samples
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                sample = json.loads(line)
            except json.JSONDecodeError:
                break
            if sample.get("index") != len(samples):
                break
            samples.append(sample)
    return samples


def load_or_generate(
    task: str,
    tokenizer: Any,
    length_tokens: int,
    num_samples: int,
    *,
    seed: int,
    haystack_text: str,
    chat_template: bool,
    cache_dir: str | Path,
    tok_hash: str | None = None,
    on_sample: Callable[[], None] | None = None,
    flavor: str = "nvidia",
    qa_path: str | Path | None = None,
) -> list[dict]:
    """Samples ``0 ... num_samples - 1`` of (task, length), read from the cache and extended as needed.

    Args:
        task, tokenizer, length_tokens, seed, haystack_text, chat_template, flavor, qa_path: as in
            ``generate_sample``.
        num_samples: how many samples to return.
        cache_dir: folder of the JSONL caches (created if missing).
        tok_hash: precomputed :func:`tokenizer_hash` (computed if ``None``).
        on_sample: called after each newly generated sample (progress).

    Returns:
        ``num_samples`` sample dicts in index order.
    """
    tok_hash = tok_hash or tokenizer_hash(tokenizer)
    data_hash = load_qa(task, qa_path).sha256 if task in QA_SOURCES else text_hash(haystack_text)
    path = cache_path(cache_dir, task, length_tokens, tok_hash, seed, data_hash, chat_template, flavor)
    samples = read_samples(path)
    if len(samples) >= num_samples:
        return samples[:num_samples]
    for index in range(len(samples), num_samples):
        samples.append(
            generate_sample(task, tokenizer, length_tokens, index, seed, haystack_text, chat_template=chat_template,
                            flavor=flavor, qa_path=qa_path, num_samples=num_samples)
        )
        if on_sample is not None:
            on_sample()
    os.makedirs(path.parent, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(s) + "\n" for s in samples))
    return samples


def decontamination_samples(task: str, tokenizer: Any, length_tokens: int, num_samples: int, *, seed: int,
                            haystack_text: str, cache_dir: str | Path,
                            on_sample: Callable[[], None] | None = None) -> list[dict]:
    """The RULER samples a training mixture is checked against (``upcycle.make_data.RulerSamples``): samples
    ``0 .. num_samples - 1`` of (task, length) exactly as ``hylo-bench ruler`` draws them without a chat template,
    read from / added to the cache under ``cache_dir`` (give ``ruler``'s results dir to share it).

    Raises:
        ValueError: the task cannot be sized at ``length_tokens`` (``PromptTooLongError`` among them).
    """
    return load_or_generate(task, tokenizer, length_tokens, num_samples, seed=seed, haystack_text=haystack_text,
                            chat_template=False, cache_dir=cache_dir, tok_hash=tokenizer_hash(tokenizer),
                            on_sample=on_sample)
