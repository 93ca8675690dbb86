"""RULER QA (``ruler_qa_squad``, ``ruler_qa_hotpot``): local data files, their parsing, and document selection.

The question's own paragraph(s) hide among distractor paragraphs of the same dataset (ruler.md section 3.5;
NVIDIA/RULER ``scripts/data/synthetic/qa.py``, lm-eval 0.4.13 ``qa_utils.py``). Data comes from local JSON files
in their original formats; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hylo_bench.io_utils import read_text_utf8, sha256_file

QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nThe following are given documents.\n\n{context}\n\n"
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
    "\n\nQuestion: {query}"
)
DOCUMENT_TEMPLATE = "Document {i}:\n{document}"
QA_GEN_PREFIX = "Answer:"
DOC_SHUFFLE_SEED = 42
"""Documents are shuffled by a fresh ``Random(42)`` (not the sample seed): positions depend only on the count."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QASource:
    """Where one QA task's data file comes from."""

    dataset: str
    filename: str
    flag: str
    env: str
    url: str


QA_SOURCES: dict[str, QASource] = {
    "ruler_qa_squad": QASource(
        dataset="SQuAD v2.0 dev", filename="dev-v2.0.json", flag="--squad", env="HYLO_BENCH_SQUAD",
        url="https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json",
    ),
    "ruler_qa_hotpot": QASource(
        dataset="HotpotQA dev distractor v1", filename="hotpot_dev_distractor_v1.json", flag="--hotpotqa",
        env="HYLO_BENCH_HOTPOTQA",
        url="https://huggingface.co/datasets/namlh2004/hotpotqa/resolve/7e54db4656209750ff487f6fdf8e39a66dba136b/"
        "hotpot_dev_distractor_v1.json",
    ),
}  # fmt: skip
"""QA task name -> its data source (ruler.md sections 3.5 and 9; the CMU host of HotpotQA is dead, hence the HF
mirror that lm-eval 0.4.13 uses)."""


def default_data_dir() -> Path:
    """``$XDG_CACHE_HOME/hylo_bench/ruler`` (default ``~/.cache/hylo_bench/ruler``): where QA files are looked for
    when neither a flag nor an environment variable names them."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hylo_bench" / "ruler"


def _missing(task: str, tried: str) -> str:
    src = QA_SOURCES[task]
    return (
        f"RULER task {task} needs the {src.dataset} file {src.filename}, not found ({tried}). Download it from "
        f"{src.url} and pass {src.flag} PATH, set {src.env}=PATH, or save it as "
        f"{default_data_dir() / src.filename}"
    )


def locate_qa_file(task: str, path: str | Path | None = None) -> tuple[Path | None, str]:
    """Find the data file of a QA task: ``path``, else ``$<env>``, else ``default_data_dir() / <filename>``.

    Returns:
        ``(path, "")`` when the file exists, else ``(None, reason)`` with an actionable message (file name, flag,
        environment variable, download URL).

    Raises:
        ValueError: ``task`` is not a QA task.
    """
    if task not in QA_SOURCES:
        raise ValueError(f"{task!r} is not a RULER QA task; QA tasks: {', '.join(QA_SOURCES)}")
    src = QA_SOURCES[task]
    if path is not None:
        where = f"{src.flag} {path}"
    elif os.environ.get(src.env):
        path, where = os.environ[src.env], f"{src.env}={os.environ[src.env]}"
    else:
        path, where = default_data_dir() / src.filename, f"default location {default_data_dir() / src.filename}"
    path = Path(path).expanduser()
    return (path, "") if path.is_file() else (None, _missing(task, where))


def resolve_qa_file(task: str, path: str | Path | None = None) -> Path:
    """Like :func:`locate_qa_file` but raises.

    Raises:
        FileNotFoundError: the file is missing (the message says where to get it and how to pass it).
    """
    found, reason = locate_qa_file(task, path)
    if found is None:
        raise FileNotFoundError(reason)
    return found


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class QAItem:
    """One usable question: its text, gold answers, own paragraph ids and (SQuAD) same-article paragraph ids."""

    query: str
    outputs: tuple[str, ...]
    context: tuple[int, ...]
    more_context: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class QAData:
    """A parsed QA file: unique documents (sorted) and usable questions in file order.

    Compared and hashed by identity (it is an lru_cache key); :func:`load_qa` returns one object per file version.
    """

    task: str
    path: str
    sha256: str
    docs: tuple[str, ...]
    questions: tuple[QAItem, ...]


def _get(obj: Any, key: str | int, where: str, path: Path, kind: type) -> Any:
    try:
        value = obj[key]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"{path}: {where}: missing key {key!r}; is this the expected file format?") from None
    if not isinstance(value, kind):
        raise ValueError(f"{path}: {where}[{key!r}]: expected {kind.__name__}, got {type(value).__name__}")
    return value


def parse_squad(obj: Any, path: Path) -> tuple[tuple[str, ...], tuple[QAItem, ...]]:
    """SQuAD v2 ``{"data": [{"paragraphs": [{"context", "qas": [{"question", "answers": [{"text"}],
    "is_impossible"}]}]}]}`` -> (sorted unique paragraphs, answerable questions with all annotator answers).

    Raises:
        ValueError: a missing key or wrong type (file and JSON path named).
    """
    articles = _get(obj, "data", "top level", path, list)
    paragraphs = [
        _get(p, "context", f"data[{i}].paragraphs[{j}]", path, str)
        for i, a in enumerate(articles)
        for j, p in enumerate(_get(a, "paragraphs", f"data[{i}]", path, list))
    ]
    docs = tuple(sorted(set(paragraphs)))
    ids = {d: i for i, d in enumerate(docs)}
    questions = []
    for i, article in enumerate(articles):
        article_ids = [ids[p["context"]] for p in article["paragraphs"]]
        for j, para in enumerate(article["paragraphs"]):
            own = ids[para["context"]]
            for k, qa in enumerate(_get(para, "qas", f"data[{i}].paragraphs[{j}]", path, list)):
                where = f"data[{i}].paragraphs[{j}].qas[{k}]"
                if _get(qa, "is_impossible", where, path, bool):
                    continue
                answers = _get(qa, "answers", where, path, list)
                golds = tuple(_get(a, "text", f"{where}.answers[{m}]", path, str) for m, a in enumerate(answers))
                if not golds:
                    raise ValueError(f"{path}: {where}: answerable question without answers")
                more = tuple(x for x in article_ids if x != own)
                questions.append(QAItem(query=_get(qa, "question", where, path, str), outputs=golds, context=(own,),
                                        more_context=more))
    return docs, tuple(questions)


def parse_hotpotqa(obj: Any, path: Path) -> tuple[tuple[str, ...], tuple[QAItem, ...]]:
    """HotpotQA ``[{"question", "answer", "context": [[title, [sentence, ...]], ...]}]`` -> (sorted unique
    documents ``title + "\\n" + "".join(sentences)``, questions with their (normally 10) paragraphs, gold [answer]).

    Raises:
        ValueError: a missing key or wrong type (file and JSON path named).
    """
    if not isinstance(obj, list):
        raise ValueError(f"{path}: top level: expected a list of questions, got {type(obj).__name__}")

    def doc(entry: Any, where: str) -> str:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], list)):
            raise ValueError(f"{path}: {where}: expected [title, [sentences]]")
        return f"{entry[0]}\n{''.join(entry[1])}"

    per_question = [[doc(e, f"[{i}].context[{j}]") for j, e in enumerate(_get(q, "context", f"[{i}]", path, list))]
                    for i, q in enumerate(obj)]
    docs = tuple(sorted({d for ds in per_question for d in ds}))
    ids = {d: i for i, d in enumerate(docs)}
    questions = tuple(
        QAItem(query=_get(q, "question", f"[{i}]", path, str), outputs=(_get(q, "answer", f"[{i}]", path, str),),
               context=tuple(ids[d] for d in ds))
        for i, (q, ds) in enumerate(zip(obj, per_question))
    )
    return docs, questions


@functools.lru_cache(maxsize=4)
def _load(task: str, path: str, mtime_ns: int, size: int) -> QAData:
    p = Path(path)
    try:
        obj = json.loads(read_text_utf8(p, f"{task} data file"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e}); expected {QA_SOURCES[task].dataset} ({QA_SOURCES[task].url})")
    docs, questions = (parse_squad if task == "ruler_qa_squad" else parse_hotpotqa)(obj, p)
    if not questions:
        raise ValueError(f"{p}: holds no usable questions for {task}")
    return QAData(task=task, path=str(p), sha256=sha256_file(p), docs=docs, questions=questions)


def load_qa(task: str, path: str | Path | None = None) -> QAData:
    """Parse the data file of a QA task (found by :func:`resolve_qa_file`); cached per file version.

    Raises:
        FileNotFoundError: the file is missing. ValueError: it is not in the expected format.
    """
    p = resolve_qa_file(task, path).resolve()
    st = p.stat()
    return _load(task, str(p), st.st_mtime_ns, st.st_size)


def _distinct_draws(rng: random.Random, num_docs: int, exclude: set[int]) -> Iterator[int]:
    """Distinct random document ids not in ``exclude``; a prefix of the stream does not depend on its length."""
    seen = set(exclude)
    while len(seen) < num_docs:
        i = rng.randrange(num_docs)
        if i not in seen:
            seen.add(i)
            yield i


def candidate_docs(item: QAItem, num_total: int, rng: random.Random) -> tuple[list[int], Iterator[int]]:
    """The priority order of distractors for one question: same-article paragraphs in random order (a list),
    then other documents as a lazy random stream. Draws from ``rng`` in a fixed order."""
    more = list(item.more_context)
    rng.shuffle(more)
    return more, _distinct_draws(rng, num_total, set(item.context) | set(item.more_context))


def select_docs(data: QAData, item: QAItem, num_docs: int, rng: random.Random, flavor: str,
                extra: tuple[int, ...] = ()) -> list[int]:
    """Document ids of one sample, before the fixed shuffle (ruler.md section 3.5).

    Priority: the question's own paragraph(s) (always kept), then its article's other paragraphs (all of them, in
    article order, when they fit; else a random subset), then random other documents. At ``num_docs >= #docs``
    lm-eval takes the whole corpus and stops there; ``flavor="nvidia"`` repeats the corpus (sorted order) to fill.
    ``extra`` ids (the sizing's gap fill) are appended.
    """
    own, more_all = list(item.context), list(item.more_context)
    total = len(data.docs)
    if num_docs >= total and flavor == "lm-eval":
        return list(range(total)) + list(extra)
    more, others = candidate_docs(item, total, rng)
    k = num_docs - len(own)
    if k <= 0:
        chosen = own
    elif k <= len(more):
        chosen = own + more[:k]
    else:
        chosen = own + more_all + list(itertools.islice(others, k - len(more)))
        chosen += [i % total for i in range(num_docs - len(chosen))]  # corpus exhausted (nvidia): repeat it
    return chosen + list(extra)


def fill_candidates(data: QAData, item: QAItem, num_docs: int, rng: random.Random, limit: int) -> list[int]:
    """Up to ``limit`` next documents in the priority order after the first ``num_docs`` (for the gap fill)."""
    own = len(item.context)
    if num_docs >= len(data.docs):
        return []
    more, others = candidate_docs(item, len(data.docs), rng)
    k = max(0, num_docs - own)
    out = more[k:k + limit]
    if k > len(more):
        for _ in range(k - len(more)):
            next(others, None)
    for i in others:
        if len(out) >= limit:
            break
        out.append(i)
    return out


def qa_text(data: QAData, item: QAItem, doc_ids: list[int]) -> str:
    """The lm-eval ``input``: template with the documents shuffled by a fresh ``Random(42)`` and numbered from 1."""
    docs = [data.docs[i] for i in doc_ids]
    random.Random(DOC_SHUFFLE_SEED).shuffle(docs)
    context = "\n\n".join(DOCUMENT_TEMPLATE.format(i=i + 1, document=d) for i, d in enumerate(docs))
    return QA_TEMPLATE.format(context=context, query=item.query)
