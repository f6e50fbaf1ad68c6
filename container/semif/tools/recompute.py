"""Recompute an answer's `option_logits` from its `prompt.recompute` record, in a fresh llama.cpp context.

    semif-recompute answer.json --model model.gguf     # an answer saved from a request with "return_prompt": true

The record (docs/explanation/scoring.md, "Recomputing an answer") lists the token segments exactly as the adapter
decoded them and the context settings that change a logit. This tool uses llama-cpp-python only (not the
adapter's engine): it loads the GGUF with those settings, decodes each segment as llama_decode calls of at
most `n_batch` tokens from the segment's first position (a segment that starts before the previous one ended
first drops the cells from its position on), logits requested only where the record says, and
reads the label logits (or, for sequence scoring, the answers' mean log-probabilities). It prints the
largest |recomputed - reported| logit per decision and exits 1 when one exceeds --tolerance.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

RULED_OUT_LOGIT = -1e30  # what an answer reports for a label the model rules out (-inf)


def _logsumexp(values: Sequence[float]) -> float:
    array = np.asarray(values, dtype=np.float64)
    peak = array.max()
    if not np.isfinite(peak):
        return float(peak)
    return float(peak + np.log(np.exp(array - peak).sum()))


def _log_softmax(logits: Sequence[float]) -> np.ndarray:
    values = np.asarray(logits, dtype=np.float64)
    values = values - values.max()
    return np.clip(values - np.log(np.exp(values).sum()), math.log(1e-300), None)


class FreshContext:
    """One llama.cpp context with a record's settings, one sequence, emptied before each recompute."""

    def __init__(self, model_path: str | Path, settings: dict, *, n_threads: Optional[int] = None):
        import llama_cpp

        self._lc = llama_cpp
        type_k = getattr(llama_cpp, f"GGML_TYPE_{settings.get('type_k', 'f16').upper()}")
        type_v = getattr(llama_cpp, f"GGML_TYPE_{settings.get('type_v', 'f16').upper()}")
        self.settings = dict(settings)
        self.llm = llama_cpp.Llama(
            model_path=str(model_path), n_ctx=settings["n_ctx"], n_batch=settings["n_batch"],
            n_ubatch=settings["n_ubatch"], flash_attn=bool(settings["flash_attn"]), type_k=type_k, type_v=type_v,
            swa_full=bool(settings.get("swa_full", True)), n_gpu_layers=settings.get("n_gpu_layers", 0),
            n_threads=n_threads, n_threads_batch=n_threads, logits_all=False, verbose=False,
        )
        self.n_batch = settings["n_batch"]
        self.n_vocab = self.llm.n_vocab()
        self._ctx = self.llm._ctx.ctx
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)

    def matches(self, settings: dict) -> bool:
        return self.settings == settings

    def clear(self) -> None:
        self._lc.llama_memory_clear(self._memory, True)

    def rewind(self, n_keep: int) -> None:
        if not self._lc.llama_memory_seq_rm(self._memory, 0, n_keep, -1):
            raise RuntimeError("this model cannot drop the tail of a sequence; recompute each answer from scratch")

    def decode(self, pos: int, tokens: Sequence[int], logits_at: set[int]) -> dict[int, np.ndarray]:
        """One segment: llama_decode calls of at most n_batch tokens from ``pos``; rows at ``logits_at``."""
        lc, batch, rows = self._lc, self._batch, {}
        for offset in range(0, len(tokens), self.n_batch):
            chunk = tokens[offset : offset + self.n_batch]
            first = pos + offset
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                batch.token[i] = int(token)
                batch.pos[i] = first + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = (first + i) in logits_at
            status = lc.llama_decode(self._ctx, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode failed with status {status}")
            for i in range(len(chunk)):
                if (first + i) in logits_at:
                    ptr = lc.llama_get_logits_ith(self._ctx, i)
                    rows[first + i] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
        return rows

    def close(self) -> None:
        self._lc.llama_batch_free(self._batch)
        self.llm.close()


def decode_record(context: FreshContext, record: dict) -> dict[int, np.ndarray]:
    """Empty the context, decode the record's segments; the logits rows at its ``logits_at`` positions."""
    if record.get("request_prompt_segments"):
        raise ValueError("the record lists only the segments after those its batch shares (the response's "
                         "prompt.segments): take it from answers_of(response)")
    context.clear()
    want = set(record["logits_at"])
    rows: dict[int, np.ndarray] = {}
    end = 0
    for segment in record["segments"]:
        if segment["pos"] < end:  # a read in another order: it replaces what follows its shared lead
            context.rewind(segment["pos"])
        rows.update(context.decode(segment["pos"], segment["tokens"], want))
        end = segment["pos"] + len(segment["tokens"])
    return rows


def _order_logits(context: FreshContext, record: dict) -> list[float]:
    """One order's option logits, from an empty context."""
    rows = decode_record(context, record)
    last = record["logits_at"][-1]
    if record["scoring"] == "label":
        row = rows[last]
        logits = [_logsumexp([float(row[t]) for t in v]) if len(v) > 1 else float(row[v[0]])
                  for v in record["label_variant_ids"]]
        return [x if x != -math.inf else RULED_OUT_LOGIT for x in logits]
    # Sequence scoring: the mean log-probability of each answer's tokens after the prompt.
    first_row = rows[last].astype(np.float64)
    first_norm = _logsumexp(first_row)
    prompt_len = last + 1
    scores = []
    for answer in record["answers"]:
        logprobs = [first_row[answer[0]] - first_norm]
        tail = answer[:-1]
        if tail:
            context.rewind(prompt_len)
            positions = set(range(prompt_len, prompt_len + len(tail)))
            tail_rows = context.decode(prompt_len, tail, positions)
            for k, token in enumerate(answer[1:]):
                row = tail_rows[prompt_len + k].astype(np.float64)
                logprobs.append(row[token] - _logsumexp(row))
        score = float(sum(logprobs) / len(logprobs))
        scores.append(score if math.isfinite(score) else RULED_OUT_LOGIT)
    return scores


def recompute_logits(record: dict, model_path: str | Path, *, context: Optional[FreshContext] = None,
                     n_threads: Optional[int] = None) -> list[float]:
    """``option_logits`` recomputed from one answer's ``prompt.recompute`` record. ``context``: a FreshContext
    to reuse (its settings must be the record's); otherwise one is made and closed."""
    own = context is None
    if own:
        context = FreshContext(model_path, record["settings"], n_threads=n_threads)
    elif not context.matches(record["settings"]):
        raise ValueError("the context's settings are not the record's")
    try:
        logits = _order_logits(context, record)
        prior = record.get("content_free_log_prior")
        if prior is not None:
            # debias "content_free": the raw logits less the content-free log-prior the answer applied (a
            # label the raw answer rules out stays ruled out).
            shifted = np.asarray(logits, dtype=np.float64) - np.asarray(prior, dtype=np.float64)
            return [RULED_OUT_LOGIT if raw <= RULED_OUT_LOGIT else float(v) for raw, v in zip(logits, shifted)]
        if record.get("reads") is not None:
            # debias "reverse" and "rotations": the mean of every read's log-probabilities (this record is the
            # first read, in its own order), each put back in the given order.
            reads = [(logits, record["order"])] + [(_order_logits(context, r), r["order"]) for r in record["reads"]]
            total = sum(_log_softmax(_in_given(shown, order)) for shown, order in reads)
            return (total / len(reads)).tolist()
        reversed_ = record.get("reversed")
        if reversed_ is None:
            return logits
        # A reverse record that lists its other order as `reversed` (the given order first): the mean of both
        # orders' log-probabilities, the reversed one put back in the given order.
        back = _in_given(_order_logits(context, reversed_), reversed_["order"])
        return ((_log_softmax(logits) + _log_softmax(back)) / 2).tolist()
    finally:
        if own:
            context.close()


def _in_given(shown: Sequence[float], order: Sequence[int]) -> list[float]:
    """Logits in shown order put back in the given order (``order[p]``: the option shown at position p)."""
    out = [0.0] * len(shown)
    for position, original in enumerate(order):
        out[original] = shown[position]
    return out


def answers_of(body: dict) -> list[dict]:
    """The decisions of a SemIf response: one answer, or each of ``results`` with its recompute records made
    whole again (a batch lists the segments its decisions share once, in the response's ``prompt.segments``)."""
    if "results" not in body:
        return [body]
    shared = (body.get("prompt") or {}).get("segments") or []
    answers = []
    for answer in body["results"]:
        record = (answer.get("prompt") or {}).get("recompute")
        if record:
            answer = dict(answer, prompt=dict(answer["prompt"], recompute=whole_record(record, shared)))
        answers.append(answer)
    return answers


def whole_record(record: dict, shared: list[dict]) -> dict:
    """A recompute record from a batch, its first ``request_prompt_segments`` segments taken from ``shared``."""
    count = record.get("request_prompt_segments", 0)
    whole = {k: v for k, v in record.items() if k != "request_prompt_segments"}
    whole["segments"] = list(shared[:count]) + list(record["segments"])
    if record.get("reversed"):
        whole["reversed"] = whole_record(record["reversed"], shared)
    if record.get("reads"):
        whole["reads"] = [whole_record(r, shared) for r in record["reads"]]
    return whole


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="semif-recompute", description=__doc__.split("\n\n")[0])
    parser.add_argument("answer", help="a SemIf response (JSON) from a request with \"return_prompt\": true; - for stdin")
    parser.add_argument("--model", required=True, help="the GGUF the answer names (model.sha256)")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest |difference| accepted per logit (default 1e-4)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (they do not change the logits)")
    args = parser.parse_args(argv)
    text = sys.stdin.read() if args.answer == "-" else Path(args.answer).read_text()
    body = json.loads(text)
    contexts: dict[str, FreshContext] = {}
    worst = 0.0
    try:
        for answer in answers_of(body):
            record = (answer.get("prompt") or {}).get("recompute")
            if not record:
                print(f"{answer.get('id')}: no prompt.recompute record (send \"return_prompt\": true)", file=sys.stderr)
                return 2
            key = json.dumps(record["settings"], sort_keys=True)
            if key not in contexts:
                contexts[key] = FreshContext(args.model, record["settings"], n_threads=args.threads)
            logits = recompute_logits(record, args.model, context=contexts[key])
            diff = float(np.max(np.abs(np.subtract(logits, answer["option_logits"]))))
            worst = max(worst, diff)
            print(json.dumps({"id": answer.get("id"), "option_logits": logits, "max_abs_diff": diff}))
    finally:
        for context in contexts.values():
            context.close()
    print(f"max |recomputed - reported| logit: {worst:.3g} (tolerance {args.tolerance:g})", file=sys.stderr)
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
