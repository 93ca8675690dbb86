"""Training documents: reading ``--data`` files (``.txt`` blocks, ``.jsonl`` / ``.parquet`` rows, folders of them,
text or conversations) into documents with ids, and tokenizing a document (a conversation through the chat
template). Used by the corpus (:mod:`hylo_bench.upcycle.data`), mixtures (:mod:`hylo_bench.upcycle.mixture`) and
decontamination (:mod:`hylo_bench.upcycle.decontam`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from hylo_bench.config.mixture import FORMATS


def shipped_text_path() -> Path:
    """Path of the public-domain text shipped in the package (Bierce, The Devil's Dictionary, 1911)."""
    from importlib import resources

    return Path(str(resources.files("hylo_bench") / "data" / "devils-dictionary.txt"))


def shipped_text() -> str:
    """The public-domain text shipped in the package (Bierce, The Devil's Dictionary, 1911)."""
    return shipped_text_path().read_text(encoding="utf-8")


def split_documents(text: str) -> list[str]:
    """Documents = blocks separated by blank lines (empty blocks dropped)."""
    return [d.strip() for d in text.split("\n\n") if d.strip()]


def load_documents(path: str | Path) -> list[Document]:
    """Read documents from a .txt / .jsonl / .parquet file or a directory of them (see
    :func:`load_documents_with_ids`)."""
    return [doc for _, doc in load_documents_with_ids(path)]


Document = Union[str, list]
"""A training document: plain text, or a conversation ``[{"role", "content"}, ...]`` (``hylo_bench.text.chat``)."""
DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")


def row_document(row, where: str, text_field: str, fmt: str, columns: tuple[str, str] | None = None) -> Document:
    """The document of one JSONL / parquet / hub row: its ``text_field`` (format ``text``), its conversation
    (``chat``), or whichever it has (``auto``: the text field first). ``columns`` (prompt, response): read the row
    as a one-turn conversation from these two columns.

    Raises:
        ValueError: naming ``where`` and the expected fields.
    """
    from hylo_bench.text.chat import ROW_SHAPES, conversation_from_row

    if columns is not None:
        if not isinstance(row, dict) or not all(isinstance(row.get(c), str) for c in columns):
            keys = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise ValueError(f"{where}: expected string columns {columns[0]!r} and {columns[1]!r}; found {keys}")
        row = {"prompt": row[columns[0]], "response": row[columns[1]]}
    if fmt != "chat" and isinstance(row, dict) and text_field in row:
        if not isinstance(row[text_field], str):
            raise ValueError(f"{where}: field {text_field!r} must be a string, got {type(row[text_field]).__name__}")
        return row[text_field]
    conv = conversation_from_row(row, where) if fmt != "text" else None
    if conv is None:
        want = {"text": f"a {text_field!r} field", "chat": ROW_SHAPES,
                "auto": f"a {text_field!r} field, or {ROW_SHAPES}"}[fmt]
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f"{where}: expected a JSON object with {want}; found {keys}")
    return conv


def read_document_file(f: Path, name: str, text_field: str = "text", fmt: str = "auto",
                       columns: tuple[str, str] | None = None) -> list[tuple[str, Document]]:
    """``(doc_id, document)`` of one data file: blank-line blocks of a ``.txt`` (ids ``name#k``), rows of a
    ``.jsonl`` (``name:line``) or ``.parquet`` (``name:row``), 1-based; rows as :func:`row_document` reads them.

    Raises:
        ValueError: unsupported suffix, unreadable row (file and line named), missing pyarrow for parquet.
    """
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if f.suffix == ".txt":
        return [(f"{name}#{k}", d) for k, d in enumerate(split_documents(f.read_text(encoding="utf-8")), 1)]
    if f.suffix == ".jsonl":
        docs: list[tuple[str, Document]] = []
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{f}:{n}: not valid JSON ({e})") from None
            docs.append((f"{name}:{n}", row_document(row, f"{f}:{n}", text_field, fmt, columns)))
        return docs
    if f.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ValueError(f"{f}: reading .parquet needs pyarrow (pip install pyarrow)") from e
        rows = pq.read_table(f).to_pylist()
        return [(f"{name}:{n}", row_document(row, f"{f} row {n}", text_field, fmt, columns))
                for n, row in enumerate(rows, 1) if not (isinstance(row, dict) and row.get(text_field, "") is None)]
    raise ValueError(f"{f}: unsupported file type {f.suffix!r}; use {', '.join(DATA_SUFFIXES)}")


def load_documents_with_ids(path: str | Path) -> list[tuple[str, Document]]:
    """``(doc_id, document)`` documents of a .txt / .jsonl / .parquet file or a directory of them, files in sorted
    order (:func:`read_document_file`; JSONL / parquet rows are text or conversations).

    Ids: ``"<file>:<line>"`` for JSONL / parquet rows, ``"<file>#<block>"`` for blank-line blocks of text files
    (1-based; ``<file>`` relative to a directory ``path``, the file name otherwise); ``"demo#<block>"`` for ``demo``.

    Raises:
        FileNotFoundError: missing path. ValueError: unsupported suffix, bad JSONL line (file and line named),
        or no text found.
    """
    if str(path) == "demo":
        return [(f"demo#{k}", d) for k, d in enumerate(split_documents(shipped_text()), 1)]
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"--data {p}: no such file or directory")
    files = sorted(f for f in p.rglob("*") if f.suffix in DATA_SUFFIXES) if p.is_dir() else [p]
    docs: list[tuple[str, Document]] = []
    for f in files:
        if f.suffix not in DATA_SUFFIXES:
            raise ValueError(f"--data {f}: unsupported file type {f.suffix!r}; use {', '.join(DATA_SUFFIXES)}")
        docs += read_document_file(f, str(f.relative_to(p)) if p.is_dir() else f.name)
    if not docs:
        raise ValueError(f"--data {p}: no text found (.txt, or .jsonl / .parquet rows with a 'text' field or a "
                         f"conversation)")
    return docs


def tokenize_document(tokenizer, doc: Document, chat_template: str | None = None,
                      where: str = "document") -> tuple[list[int], list[bool] | None, bool]:
    """``(token ids, assistant mask or None, whether the packer appends EOS)`` of one document.

    Text is tokenized without special tokens and followed by EOS; a conversation is rendered with its chat
    template (``hylo_bench.text.chat.render_conversation``; the template ends each turn itself, so no EOS is added).
    """
    if isinstance(doc, str):
        return tokenizer(doc, add_special_tokens=False, verbose=False).input_ids, None, True
    from hylo_bench.text.chat import render_conversation

    r = render_conversation(tokenizer, doc, chat_template, where)
    return r.ids, r.assistant_mask, False


def document_text(doc: Document) -> str:
    """The plain text of a document (a conversation's turns joined; what decontamination compares)."""
    if isinstance(doc, str):
        return doc
    from hylo_bench.text.chat import conversation_text

    return conversation_text(doc)
