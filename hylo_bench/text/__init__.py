"""Text handling shared by the wings: chat rendering (``chat``), RULER-style haystack material (``haystack``: word
lists, needle draws, essay text, sentence splitter) and ``<think>`` span removal (``think``)."""
