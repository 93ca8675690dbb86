"""RULER raw material: wonderwords word lists, needle key/value draws, the essay corpus and its sentence splitter.

Every draw takes an explicit ``random.Random``; nothing here touches the global ``random`` or numpy state.
"""

from __future__ import annotations

import functools
import importlib.resources
import itertools
import random
import re
import uuid
from pathlib import Path

NOISE_LINE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
"""The ``repeat`` haystack line (lm-eval ``prepare_niah.get_haystack``; ruler.md section 3.1)."""

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
"""Needle sentence, always formatted with the plural value type (ruler.md section 3.1)."""

DEPTHS = tuple(round(i * 100 / 39) for i in range(40))
"""40 needle depths in percent, ``np.round(np.linspace(0, 100, 40))`` (no value sits on a .5 tie)."""

DEFAULT_ESSAY = "devils-dictionary.txt"
"""Public-domain essay haystack shipped in ``hylo_bench/data`` (Bierce, The Devil's Dictionary)."""

_ABBREVIATIONS = frozenset(
    "mr mrs ms dr st jr sr vs etc e.g i.e cf no vol pp ch fig n v adj adv prep pron conj interj v.t v.i pl "
    "a.d b.c a.m p.m gen col capt lt rev hon esq".split()
)
_SENTENCE_END = re.compile(r"[.!?]+['\")\]_]*(?= )")


def _wonderwords_list(filename: str) -> list[str]:
    """One wonderwords asset file as wonderwords reads it (``readlines`` + ``rstrip``), UTF-8."""
    text = importlib.resources.files("wonderwords.assets").joinpath(filename).read_text(encoding="utf-8")
    return [line.rstrip() for line in text.splitlines(keepends=True)]


@functools.cache
def _key_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Sorted unique adjectives and nouns; their product is lm-eval's ``WORDS`` set (6,171,620 items).

    lm-eval 0.4.13 (``prepare_niah.py``) materialises ``sorted(set(f"{adj}-{noun}"))``; the duplicates in that
    product come only from repeated list entries (``"nasty "``/``"nasty"``), so deduplicating each side gives the
    same set without building 6.2M strings (checked in tests/tasks/test_ruler_generation.py).
    """
    adjs = tuple(sorted(set(_wonderwords_list("adjectivelist.txt"))))
    nouns = tuple(sorted(set(_wonderwords_list("nounlist.txt"))))
    return adjs, nouns


@functools.cache
def cwe_words() -> tuple[str, ...]:
    """CWE word pool: nouns | adjectives | verbs (8166 words), sorted, shuffled by ``Random(42)``.

    Source: lm-eval 0.4.13 ``cwe_utils.py`` (module-level ``WORDS``); identical list.
    """
    pool = set()
    for name in ("nounlist.txt", "adjectivelist.txt", "verblist.txt"):
        pool.update(_wonderwords_list(name))
    words = sorted(pool)
    random.Random(42).shuffle(words)
    return tuple(words)


def num_key_words() -> int:
    """Size of the ``adjective-noun`` key space (6,171,620 with wonderwords 3.0.1)."""
    adjs, nouns = _key_words()
    return len(adjs) * len(nouns)


def random_word(rng: random.Random) -> str:
    """A uniform ``adjective-noun`` key (same set as lm-eval's ``WORDS``, indexed adjective-major)."""
    adjs, nouns = _key_words()
    i = rng.randrange(len(adjs) * len(nouns))
    return f"{adjs[i // len(nouns)]}-{nouns[i % len(nouns)]}"


def random_number(rng: random.Random) -> str:
    """A 7-digit number as text, 1000000 ... 9999999 (lm-eval ``generate_random_number``)."""
    return str(rng.randint(10**6, 10**7 - 1))


def random_uuid(rng: random.Random) -> str:
    """A UUID4 string from 128 random bits (lm-eval ``generate_random_uuid``)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_needle(kind: str, rng: random.Random) -> str:
    """Draw a needle key or value of ``kind`` (``words`` | ``numbers`` | ``uuids``).

    Raises:
        ValueError: unknown kind.
    """
    if kind == "words":
        return random_word(rng)
    if kind == "numbers":
        return random_number(rng)
    if kind == "uuids":
        return random_uuid(rng)
    raise ValueError(f"needle type must be one of words, numbers, uuids; got {kind!r}")


@functools.cache
def default_haystack_text() -> str:
    """The shipped essay haystack text (``hylo_bench/data/devils-dictionary.txt``)."""
    return importlib.resources.files("hylo_bench").joinpath("data", DEFAULT_ESSAY).read_text(encoding="utf-8")


def read_haystack_text(path: str | Path | None) -> str:
    """Read an essay haystack file (UTF-8); ``None`` returns the shipped default.

    Raises:
        ValueError: the file does not exist, is not UTF-8 (file and byte offset named) or holds no words.
    """
    if path is None:
        return default_haystack_text()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"haystack_path {str(path)!r} is not a file; pass a UTF-8 text file or omit it")
    from hylo_bench.io_utils import read_text_utf8

    text = read_text_utf8(path, "--haystack")
    if not text.split():
        raise ValueError(f"haystack_path {str(path)!r} holds no words")
    return text


@functools.lru_cache(maxsize=4)
def essay_words(text: str) -> tuple[str, ...]:
    """Whitespace-normalised words of an essay text (lm-eval ``get_haystack("essay")``).

    Raises:
        ValueError: the text holds no words.
    """
    words = tuple(re.sub(r"\s+", " ", text.strip()).split(" "))
    if words == ("",):
        raise ValueError("the essay haystack text holds no words")
    return words


def essay_prefix(words: tuple[str, ...], num_words: int) -> str:
    """The first ``num_words`` words joined by spaces, repeating the corpus if it is too short.

    Repeating follows NVIDIA/RULER ``niah.py``; lm-eval 0.4.13 instead caps the haystack at the corpus end
    (ruler.md section 8 row 7).
    """
    if num_words <= len(words):
        return " ".join(words[:num_words])
    return " ".join(itertools.islice(itertools.cycle(words), num_words))


def split_sentences(text: str) -> list[str]:
    """Split single-space-separated text into sentences with a regex (offline stand-in for NLTK punkt).

    A sentence ends at ``.``, ``!`` or ``?`` (plus closing quotes, brackets or ``_``) followed by a space and a
    word that starts with an upper-case letter, digit, quote or bracket; a bare period after a known
    abbreviation (``Dr.``, ``n.``, ``e.g.``) or a single letter does not end one. Joining the result with single
    spaces gives ``text`` back.

    Deviation: lm-eval 0.4.13 uses ``nltk.sent_tokenize`` (punkt_tab), unavailable offline; the split only
    decides where needles may be inserted (ruler.md section 3.1).
    """
    sentences, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        end = match.end()
        nxt = text[end + 1 : end + 2]
        if not nxt or not (nxt.isupper() or nxt.isdigit() or nxt in "\"'([_"):
            continue
        space = text.rfind(" ", start, match.start())
        word = text[space + 1 if space >= 0 else start : match.start()].strip("\"'([_").lower()
        if match.group() == "." and (word in _ABBREVIATIONS or len(word) == 1):
            continue
        sentences.append(text[start:end])
        start = end + 1
    if start < len(text):
        sentences.append(text[start:])
    return sentences
