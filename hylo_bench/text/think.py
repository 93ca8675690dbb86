"""Text post-processing shared by ``generate`` and every scorer: removing ``<think>...</think>`` reasoning spans.

Qwen3-based checkpoints emit their reasoning between ``<think>`` and ``</think>``; in non-thinking mode they
still emit an empty ``<think>\\n\\n</think>\\n\\n`` prefix. Scorers that string-match the answer should not see
either. :func:`strip_think` works on a whole string; :class:`ThinkStripper` does the same on a stream of text
pieces (what ``hylo-bench generate --strip-think`` prints while tokens arrive).

Rules (both entry points):

1. Every ``<think> ... </think>`` span is removed, together with the whitespace right after ``</think>``.
2. A ``<think>`` that is never closed removes everything from it to the end (generation stopped mid-thought).
3. A ``</think>`` with no ``<think>`` before it closes a span opened before the text began (by a chat template
   whose generation prompt ends in ``<think>``): everything up to it is removed, as in rule 1.
   ``ThinkStripper`` can only apply this when told so (``start_inside=True``): it cannot take back text it
   already returned, so an unexpected ``</think>`` in a stream is dropped alone.
"""

from __future__ import annotations

import re

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_SPAN = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def strip_think(text: str) -> str:
    """``text`` without its ``<think>`` reasoning spans (rules 1-3 of the module docstring).

    Examples:
        ``"<think>\\n\\n</think>\\n\\nParis"`` -> ``"Paris"``;
        ``"A <think>x</think> B"`` -> ``"A B"``; ``"Paris <think>but"`` -> ``"Paris "``;
        ``"reasoning</think>\\nParis"`` -> ``"Paris"``; text without tags is returned unchanged.
    """
    first_close, first_open = text.find(THINK_CLOSE), text.find(THINK_OPEN)
    if first_close != -1 and (first_open == -1 or first_close < first_open):  # rule 3
        text = text[first_close + len(THINK_CLOSE):].lstrip()
    text = _SPAN.sub("", text)
    cut = text.find(THINK_OPEN)  # rule 2: an unterminated span runs to the end
    return text if cut == -1 else text[:cut]


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with (0 when none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkStripper:
    """Streaming :func:`strip_think`: ``feed`` text pieces as they arrive, ``flush`` at the end.

    The concatenation of everything ``feed`` and ``flush`` return equals ``strip_think`` of the concatenated
    input, except for an unexpected ``</think>`` (rule 3 of the module docstring). Text is held back only
    while it could be the start of a tag or while inside a span.

    Args:
        start_inside: the text starts inside a span (the prompt ended with an open ``<think>``).
    """

    def __init__(self, start_inside: bool = False) -> None:
        self._inside = start_inside
        self._skip_ws = False  # drop whitespace right after a closing tag
        self._buf = ""

    def feed(self, piece: str) -> str:
        """Add ``piece``; returns the text that is now known to lie outside every span."""
        self._buf += piece
        out = []
        while self._buf:
            if self._inside:
                i = self._buf.find(THINK_CLOSE)
                if i == -1:  # keep only what could be the start of "</think>"
                    keep = _partial_tag_suffix(self._buf, THINK_CLOSE)
                    self._buf = self._buf[len(self._buf) - keep:] if keep else ""
                    break
                self._buf, self._inside, self._skip_ws = self._buf[i + len(THINK_CLOSE):], False, True
                continue
            if self._skip_ws:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._skip_ws = False
            i, j = self._buf.find(THINK_OPEN), self._buf.find(THINK_CLOSE)
            if j != -1 and (i == -1 or j < i):  # unexpected "</think>": drop the tag alone
                out.append(self._buf[:j])
                self._buf, self._skip_ws = self._buf[j + len(THINK_CLOSE):], True
                continue
            if i != -1:
                out.append(self._buf[:i])
                self._buf, self._inside = self._buf[i + len(THINK_OPEN):], True
                continue
            keep = max(_partial_tag_suffix(self._buf, THINK_OPEN), _partial_tag_suffix(self._buf, THINK_CLOSE))
            out.append(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(out)

    def flush(self) -> str:
        """End of the stream: returns held-back text that turned out not to be a tag ("" inside a span)."""
        rest, self._buf = ("" if self._inside else self._buf), ""
        if self._skip_ws:
            rest = rest.lstrip()
        return rest
