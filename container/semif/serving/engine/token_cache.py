"""Tokens of short template strings, kept: the tokenizer runs once per distinct piece of template text."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from typing import Callable

__all__ = ["TokenCache"]


class TokenCache:
    """Tokens of short strings by (text, add_bos), least recently used dropped first; bounded by entries
    and by the total characters of the strings it holds, each of which is at most ``max_chars`` long
    (a longer one is tokenized on every call, never kept). Thread-safe: plans are built off the model thread."""

    def __init__(self, tokenize: Callable[[str, bool], tuple], *, max_entries: int, max_chars: int, max_total_chars: int):
        self._tokenize = tokenize
        self.max_entries, self.max_chars, self.max_total_chars = max_entries, max_chars, max_total_chars
        self._entries: "OrderedDict[tuple[str, bool], tuple[int, ...]]" = OrderedDict()
        self.total_chars = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def __call__(self, text: str, add_bos: bool) -> tuple[int, ...]:
        key = (text, add_bos)
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        tokens = tuple(self._tokenize(text, add_bos))
        if len(text) > self.max_chars:
            return tokens
        with self._lock:
            if key not in self._entries:
                self._entries[key] = tokens
                self.total_chars += len(text)
                while len(self._entries) > self.max_entries or self.total_chars > self.max_total_chars:
                    (old, _), _ = self._entries.popitem(last=False)
                    self.total_chars -= len(old)
        return tokens

    def __len__(self) -> int:
        return len(self._entries)

    def cache_info(self):
        """Hits, misses and size, as functools.lru_cache's ``cache_info`` names them."""
        return functools._CacheInfo(self.hits, self.misses, self.max_entries, len(self._entries))

    def cache_clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.total_chars = 0

