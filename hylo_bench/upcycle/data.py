"""Distillation data: text sources, the demo mixture, and fixed-length token windows.

``--data`` is ``demo`` (the shipped public-domain text plus RULER-style retrieval samples built with the
project's generator and training seeds disjoint from evaluation), or a path: a ``.txt`` file (documents
separated by blank lines), a ``.jsonl`` file (``text`` field per line), or a directory of such files.
Windows are deterministic given the seed, so a resumed run sees the same batches.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from pathlib import Path

import torch

from hylo_bench.tasks.ruler import generate_sample

DEMO_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
              "niah_multiquery", "niah_multivalue")
TRAIN_SEED_BASE = 10_000
ANSWER_ROOM = 48  # tokens left for the gold answer + EOS in a retrieval window
logger = logging.getLogger(__name__)  # evaluation uses seed 42; training samples never share its per-sample seeds


def shipped_text() -> str:
    """The public-domain text shipped in the package (Bierce, The Devil's Dictionary, 1911)."""
    from importlib import resources

    return (resources.files("hylo_bench") / "data" / "devils-dictionary.txt").read_text(encoding="utf-8")


def split_documents(text: str) -> list[str]:
    """Documents = blocks separated by blank lines (empty blocks dropped)."""
    return [d.strip() for d in text.split("\n\n") if d.strip()]


def load_documents(path: str | Path) -> list[str]:
    """Read documents from a .txt / .jsonl file or a directory of them.

    Raises:
        FileNotFoundError: missing path. ValueError: unsupported suffix, bad JSONL line (file and line named),
        or no text found.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"--data {p}: no such file or directory")
    files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".jsonl")) if p.is_dir() else [p]
    docs: list[str] = []
    for f in files:
        if f.suffix == ".txt":
            docs += split_documents(f.read_text(encoding="utf-8"))
        elif f.suffix == ".jsonl":
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    docs.append(str(json.loads(line)["text"]))
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{f}:{n}: expected a JSON object with a 'text' field ({e})") from e
        else:
            raise ValueError(f"--data {f}: unsupported file type {f.suffix!r}; use .txt or .jsonl")
    if not docs:
        raise ValueError(f"--data {p}: no text found (.txt or .jsonl files with a 'text' field)")
    return docs


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


def retrieval_examples(tokenizer, seq_len: int, count: int, seed: int) -> list[list[int]]:
    """Up to ``count`` RULER-style examples (prompt + gold answer + EOS) of at most ``seq_len`` tokens.

    Uses the project's RULER generator with seeds ``TRAIN_SEED_BASE + seed`` (never the evaluation seeds). The
    generator reserves ``max_gen_toks`` for the answer; we ask for ``seq_len + max_gen_toks - ANSWER_ROOM`` so
    prompt + answer fill the window. Returns [] when ``seq_len`` is too short for a retrieval prompt.
    """
    from hylo_bench.tasks.ruler import get_task

    text = shipped_text()
    out = []
    for i in range(count):
        task = DEMO_TASKS[i % len(DEMO_TASKS)]
        target = seq_len + get_task(task).max_gen_toks - ANSWER_ROOM
        try:
            s = generate_sample(task, tokenizer, target, index=i, seed=TRAIN_SEED_BASE + seed, haystack_text=text)
        except ValueError:  # the window is shorter than the task's smallest prompt
            _warn_once(f"stage length {seq_len} tokens is too short for RULER-style retrieval examples; the demo data "
                       f"of this length is text only")
            return []
        answer = " " + ", ".join(s["outputs"]) + "."
        ids = tokenizer(s["prompt"]).input_ids + tokenizer(answer, add_special_tokens=False).input_ids
        ids.append(tokenizer.eos_token_id)
        if len(ids) <= seq_len:
            out.append(ids)
    return out


def pack_windows(examples: list[list[int]], filler: list[int], seq_len: int) -> torch.Tensor:
    """One window per example: the example (truncated to ``seq_len``) followed by filler tokens.

    Returns:
        [len(examples), seq_len] int64 token ids.
    """
    rows = []
    pos = 0
    for ex in examples:
        row = ex[:seq_len]
        need = seq_len - len(row)
        while need > 0:
            take = filler[pos:pos + need]
            if not take:
                pos = 0
                continue
            row = row + take
            pos += len(take)
            need -= len(take)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.long)


def text_windows(docs: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Concatenate documents (EOS between them) and cut into [N, seq_len] windows (the tail is dropped).

    Raises:
        ValueError: when the text is shorter than one window.
    """
    ids: list[int] = []
    for d in docs:
        ids += tokenizer(d, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"the data has {len(ids)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def build_windows(data: str, tokenizer, seq_len: int, num_windows: int, seed: int) -> torch.Tensor:
    """``num_windows`` training windows [num_windows, seq_len] for one stage, deterministic in ``seed``.

    ``demo``: half retrieval examples packed with text filler, half plain text windows. A path: text windows
    (cycled when the budget asks for more windows than the data holds).
    """
    rng = random.Random(seed)
    if data == "demo":
        docs = split_documents(shipped_text())
        text = text_windows(docs, tokenizer, seq_len)
        examples = retrieval_examples(tokenizer, seq_len, num_windows // 2, seed)
        ret = pack_windows(examples, text.flatten().tolist(), seq_len) if examples else \
            torch.empty(0, seq_len, dtype=torch.long)
        n_ret = len(ret)
        idx = [rng.randrange(len(text)) for _ in range(num_windows - n_ret)]
        windows = torch.cat([ret, text[idx]])
    else:
        text = text_windows(load_documents(data), tokenizer, seq_len)
        idx = [i % len(text) for i in range(num_windows)]
        windows = text[idx]
    order = list(range(len(windows)))
    rng.shuffle(order)
    return windows[order]
