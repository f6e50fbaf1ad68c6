#!/usr/bin/env python
"""Fence-tag search on a 1 MiB state stuffed with <state-N> tags: the old one-tag-at-a-time search
(kept here for the comparison) vs the linear one in semif/serving/engine/prompt.py.

usage: .venv/bin/python tools/bench_fence.py      (figures in docs/benchmarks.md)
"""
import itertools
import time

from semif.serving.engine.prompt import _fence_tag as linear


def old(state_text):
    """The former search: one substring scan of the whole state per candidate tag."""
    lowered = state_text.lower()
    for n in itertools.count():
        tag = "state" if n == 0 else f"state-{n}"
        if f"<{tag}>" not in lowered and f"</{tag}>" not in lowered:
            return tag

parts, size, n = ["<state>"], 7, 1
while size < 1 << 20:
    parts.append(f"<state-{n}>"); size += len(parts[-1]); n += 1
stuffed = "".join(parts)
for name, fn in (("linear", linear), ("old", old)):
    t = time.perf_counter(); tag = fn(stuffed); print(f"{name}: {time.perf_counter() - t:.3f} s -> {tag} ({len(stuffed)} chars, {n} tags)", flush=True)
