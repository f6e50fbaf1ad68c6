"""The scoring engine: one llama.cpp context, a token-prefix cache, and logits read after one forward pass.

Knows llama.cpp, tokens and prompts; knows nothing of HTTP or JSON shapes. Not thread-safe: one
computation at a time (the HTTP layer's admission control guarantees that).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import subprocess
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .manifest import sha256_file
from .prompt import Labels, PromptTemplate, Question, TEMPLATE_VERSION

log = logging.getLogger("semif.engine")

SEQ = 0  # the one sequence this context holds
LABEL_MEMO_SIZE = 256  # identical prompts remembered (label logits only: a few floats each)


class EngineError(Exception):
    """A request the engine cannot score as asked; ``code`` is stable for clients."""

    code = "engine_error"

    def __init__(self, message: str, *, field: Optional[str] = None):
        super().__init__(message)
        self.field = field


class PromptTooLong(EngineError):
    code = "prompt_too_long"

    def __init__(self, tokens: int, n_ctx: int, *, field: Optional[str] = None):
        super().__init__(f"prompt needs {tokens} tokens but the context holds {n_ctx}", field=field)
        self.tokens = tokens
        self.n_ctx = n_ctx


class LabelError(EngineError):
    code = "unsupported_options"


@dataclass
class Distribution:
    """One question's answer: a distribution over its outcomes, in the order they were given."""

    option_logits: list[float]
    probabilities: list[float]
    tokens: int  # prompt tokens of this question (state prefix + question)
    cached_tokens: int  # of those, reused from the context without evaluation
    evaluated_tokens: int  # tokens actually run through the model for this question
    scoring: str
    label_token_ids: Optional[list[int]] = None
    labels: Optional[list[str]] = None
    prompt_text: Optional[str] = None
    compute_ms: float = 0.0


@dataclass
class ScoreResult:
    distributions: list[Distribution]
    state_tokens: int
    input_tokens: int  # distinct prompt tokens of the request: state prefix once + every question suffix
    cached_tokens: int  # state-prefix tokens found in the context from earlier requests
    evaluated_tokens: int
    compute_ms: float


def softmax(logits: Sequence[float]) -> list[float]:
    values = np.asarray(logits, dtype=np.float64)
    values = np.exp(values - values.max())
    return (values / values.sum()).tolist()


def _log_softmax_rows(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    peak = rows.max(axis=1, keepdims=True)
    return rows - peak - np.log(np.exp(rows - peak).sum(axis=1, keepdims=True))


def _tokens_key(prefix: Sequence[Sequence[int]], suffix: Sequence[int], label_ids: Sequence[int]) -> bytes:
    digest = hashlib.sha256()
    for part in (*prefix, suffix, label_ids):
        digest.update(np.asarray(part, dtype=np.int64).tobytes())
        digest.update(b"|")
    return digest.digest()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_name() -> Optional[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=5
        )
        names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        return ", ".join(names) or None
    except (OSError, subprocess.SubprocessError):
        return None


class Engine:
    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_threads: Optional[int] = None,
        n_gpu_layers: int = -1,
        prefix_cache: bool = True,
        default_scoring: str = "label",
        model_sha256: Optional[str] = None,
        verbose: bool = False,
    ):
        import llama_cpp  # imported here so the HTTP layer and tools import without a compiled library

        self._lc = llama_cpp
        self.model_path = Path(model_path)
        self.prefix_cache = prefix_cache
        self.default_scoring = default_scoring
        self.sha256 = model_sha256 or sha256_file(self.model_path)
        started = time.perf_counter()
        self.llm = llama_cpp.Llama(
            model_path=str(self.model_path),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_gpu_layers=n_gpu_layers,
            logits_all=False,
            verbose=verbose,
        )
        self.load_s = time.perf_counter() - started
        self.n_ctx = self.llm.n_ctx()
        self.n_batch = n_batch
        self.n_vocab = self.llm.n_vocab()
        self._ctx = self.llm._ctx.ctx
        self._model = self.llm._model.model
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        # Recurrent and hybrid models cannot drop the tail of a sequence; they rewind by restoring a
        # per-sequence snapshot taken at the end of the state prefix, or else re-evaluate from scratch.
        self.partial_rewind = not (
            llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(self._model)
        )
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._segments: list[tuple[int, ...]] = []  # what the context holds, in evaluation segments
        # Label logits of recently scored prompts, keyed by their exact tokens: an identical question
        # about an identical state is answered with the logits it already produced (exact by construction).
        self._label_memo: "OrderedDict[bytes, list[float]]" = OrderedDict()
        self._snapshot: Optional[tuple[list[tuple[int, ...]], ctypes.Array]] = None
        self.lock = threading.Lock()  # defensive: callers already serialize

        metadata = self.llm.metadata
        bos_id, eos_id = self.llm.token_bos(), self.llm.token_eos()
        self.template = PromptTemplate(
            metadata.get("tokenizer.chat_template"),
            bos_text="" if self._adds_bos() else self._piece(bos_id),
            eos_text=self._piece(eos_id),
        )
        self.labels: Labels = self.template.select_labels(lambda text: self._tokenize(text, special=True))
        self.n_gpu_layers = n_gpu_layers if llama_cpp.llama_supports_gpu_offload() else 0
        self.info = {
            "file": self.model_path.name,
            "sha256": self.sha256,
            "architecture": metadata.get("general.architecture"),
            "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_build": self._llama_build(),
            "n_gpu_layers": self.n_gpu_layers,
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
            "hardware": (_gpu_name() if llama_cpp.llama_supports_gpu_offload() else None) or _cpu_name(),
            "n_ctx": self.n_ctx,
            "chat_template": self.template.chat_template is not None,
            "template_version": TEMPLATE_VERSION,
            "template_sha256": self.template.sha256,
            "max_label_options": len(self.labels.letters.texts),
        }

    # ---- tokens -------------------------------------------------------------------------------

    def _adds_bos(self) -> bool:
        vocab = self._lc.llama_model_get_vocab(self._model)
        return bool(self._lc.llama_vocab_get_add_bos(vocab))

    def _piece(self, token: int) -> str:
        if token < 0:
            return ""
        return self.llm.detokenize([token], special=True).decode("utf-8", errors="replace")

    def _tokenize(self, text: str, *, special: bool, add_bos: bool = False) -> list[int]:
        if not text:
            return []
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def _llama_build(self) -> str:
        for name in ("llama_build_number", "LLAMA_BUILD_NUMBER"):
            value = getattr(self._lc, name, None)
            if value is not None:
                return str(value() if callable(value) else value)
        return f"llama-cpp-python-{self._lc.__version__}"

    def prefix_segments(self, state_text: str) -> tuple[str, list[list[int]]]:
        """The state prefix as evaluation segments: the template head (system text, constant across
        requests), then the fenced state in blocks of ``n_batch`` tokens. Template text may hold
        special tokens; the state never does: it is tokenized as plain text so it cannot forge a turn."""
        head, block = self.template.state_prefix_parts(state_text)
        head_tokens = self._tokenize(head, special=True, add_bos=True)
        if not head_tokens and self._adds_bos():
            head_tokens = [self.llm.token_bos()]
        state_tokens = self._tokenize(block, special=False)
        segments = [head_tokens] if head_tokens else []
        segments += [state_tokens[i : i + self.n_batch] for i in range(0, len(state_tokens), self.n_batch)]
        return head + block, segments

    def question_tokens(self, question: Question, labels: Optional[Sequence[str]]) -> tuple[str, list[int]]:
        block, tail = self.template.question_suffix_parts(question, labels)
        return block + tail, self._tokenize(block, special=False) + self._tokenize(tail, special=True)

    # ---- the context --------------------------------------------------------------------------
    #
    # Exactness rule: the context is always filled segment by segment, each segment decoded as its own
    # batch(es) from the same position, whether or not anything was cached. Reuse happens only at
    # segment boundaries. A cached answer therefore runs exactly the kernels an uncached one runs.
    # (Re-evaluating a partial segment changes the batch shape, and with it the matmul kernels and
    # their float accumulation: measured 0.05 logit drift on SmolLM2 Q4_1 for the same prompt.)

    @property
    def _cached_len(self) -> int:
        return sum(len(segment) for segment in self._segments)

    def invalidate(self) -> None:
        """Forget everything the context holds (after someone else used it, e.g. chat generation)."""
        self._lc.llama_memory_clear(self._memory, True)
        self._segments = []
        self._snapshot = None
        if not self.prefix_cache:
            self._label_memo.clear()

    def _rewind(self, n_segments: int) -> None:
        """Keep the first ``n_segments`` segments in the context, drop the rest."""
        if n_segments >= len(self._segments):
            return
        n_keep = sum(len(s) for s in self._segments[:n_segments])
        if self.partial_rewind and self._lc.llama_memory_seq_rm(self._memory, SEQ, n_keep, -1):
            self._segments = self._segments[:n_segments]
            return
        snap = self._snapshot
        if snap is not None and len(snap[0]) <= n_segments and self._segments[: len(snap[0])] == snap[0]:
            self._lc.llama_memory_seq_rm(self._memory, SEQ, -1, -1)  # removing a whole sequence never fails
            buf = snap[1]
            if self._lc.llama_state_seq_set_data(self._ctx, buf, len(buf), SEQ) == 0:
                self.invalidate()
                return
            self._segments = list(snap[0])
            return
        self.invalidate()

    def _take_snapshot(self) -> None:
        size = self._lc.llama_state_seq_get_size(self._ctx, SEQ)
        buf = (ctypes.c_uint8 * size)()
        written = self._lc.llama_state_seq_get_data(self._ctx, buf, size, SEQ)
        self._snapshot = (list(self._segments), buf) if written else None

    def _decode(self, tokens: Sequence[int], want: set[int]) -> dict[int, np.ndarray]:
        """Append one segment to the context; return the logits rows at the absolute positions in ``want``."""
        lc, batch = self._lc, self._batch
        rows: dict[int, np.ndarray] = {}
        start = self._cached_len
        for offset in range(0, len(tokens), self.n_batch):
            chunk = tokens[offset : offset + self.n_batch]
            batch.n_tokens = len(chunk)
            for i, token in enumerate(chunk):
                pos = start + offset + i
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = SEQ
                batch.logits[i] = pos in want
            status = lc.llama_decode(self._ctx, batch)
            if status != 0:
                self.invalidate()
                raise EngineError(f"llama_decode failed with status {status}")
            for i in range(len(chunk)):
                pos = start + offset + i
                if pos in want:
                    ptr = lc.llama_get_logits_ith(self._ctx, i)
                    rows[pos] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
        self._segments.append(tuple(tokens))
        return rows

    def _forward(self, segments: list[Sequence[int]], positions: list[int]) -> tuple[dict[int, np.ndarray], int, int]:
        """Logits at absolute ``positions`` (all inside the last segment), reusing the longest run of
        leading segments the context already holds. Returns (rows, reused tokens, evaluated tokens)."""
        total = sum(len(s) for s in segments)
        if total > self.n_ctx:
            raise PromptTooLong(total, self.n_ctx)
        keep = 0
        limit = len(segments) - 1  # the segment whose logits we need is always evaluated
        while keep < min(limit, len(self._segments)) and self._segments[keep] == tuple(segments[keep]):
            keep += 1
        self._rewind(keep)
        keep = len(self._segments)
        reused = self._cached_len
        rows: dict[int, np.ndarray] = {}
        want = set(positions)
        for segment in segments[keep:]:
            rows.update(self._decode(segment, want))
        return rows, reused, total - reused

    # ---- scoring ------------------------------------------------------------------------------

    def check_question(self, question: Question, scoring: str) -> None:
        """Raise LabelError if ``question`` cannot be label-scored by this model."""
        if scoring != "label":
            return
        labels = self.labels.for_question(question)
        if question.kind == "binary":
            return
        if len(question.outcomes) > len(labels.texts):
            kind = "levels" if question.kind == "scale" else "options"
            raise LabelError(
                f"label scoring supports at most {len(labels.texts)} {kind} with this model "
                f"(got {len(question.outcomes)}); use scoring 'sequence'"
            )

    def score(
        self,
        state_text: str,
        questions: Sequence[Question],
        *,
        scoring: Optional[str] = None,
        return_prompt: bool = False,
    ) -> ScoreResult:
        scoring = scoring or self.default_scoring
        if scoring not in ("label", "sequence"):
            raise EngineError(f"unknown scoring method {scoring!r}", field="scoring")
        for question in questions:
            self.check_question(question, scoring)
        started = time.perf_counter()
        with self.lock:
            if not self.prefix_cache:
                self.invalidate()
            prefix_text, prefix = self.prefix_segments(state_text)
            prefix_len = sum(len(s) for s in prefix)
            suffixes = []
            for index, question in enumerate(questions):
                labels = self.labels.for_question(question).texts if scoring == "label" else None
                text, tokens = self.question_tokens(question, labels)
                answers = self._answer_tokens(question) if scoring == "sequence" else []
                need = prefix_len + len(tokens) + max((len(a) for a in answers), default=0)
                if need > self.n_ctx:
                    raise PromptTooLong(need, self.n_ctx, field=f"questions[{index}]" if len(questions) > 1 else None)
                suffixes.append((text, tokens, answers))
            cached_from_before = 0
            for held, wanted in zip(self._segments, prefix):
                if held != tuple(wanted):
                    break
                cached_from_before += len(wanted)
            distributions = []
            evaluated = 0
            for question, (text, tokens, answers) in zip(questions, suffixes):
                q_started = time.perf_counter()
                if scoring == "label":
                    dist = self._score_labels(question, prefix, tokens)
                else:
                    dist = self._score_sequence(question, prefix, tokens, answers)
                dist.compute_ms = (time.perf_counter() - q_started) * 1000
                evaluated += dist.evaluated_tokens
                if return_prompt:
                    dist.prompt_text = prefix_text + text
                distributions.append(dist)
            if distributions and distributions[0].evaluated_tokens == 0:
                cached_from_before = prefix_len  # answered from remembered logits: nothing was evaluated
        return ScoreResult(
            distributions=distributions,
            state_tokens=prefix_len,
            input_tokens=prefix_len + sum(len(s[1]) for s in suffixes),
            cached_tokens=cached_from_before,
            evaluated_tokens=evaluated,
            compute_ms=(time.perf_counter() - started) * 1000,
        )

    def _ensure_prefix(self, prefix: list[list[int]]) -> None:
        """For models that cannot rewind partially: bring the context to exactly the state prefix and
        snapshot it, so each question restarts from here without re-evaluating the state."""
        if self.partial_rewind:
            return
        wanted = [tuple(s) for s in prefix]
        if self._snapshot is not None and self._snapshot[0] == wanted:
            return
        keep = 0
        while keep < min(len(wanted), len(self._segments)) and self._segments[keep] == wanted[keep]:
            keep += 1
        self._rewind(keep)
        for segment in prefix[len(self._segments) :]:
            self._decode(segment, set())
        self._take_snapshot()

    def _score_labels(self, question: Question, prefix: list[list[int]], suffix: list[int]) -> Distribution:
        label_set = self.labels.for_question(question)
        n = len(question.outcomes)
        label_ids = list(label_set.token_ids[:n])
        total = sum(len(s) for s in prefix) + len(suffix)
        key = _tokens_key(prefix, suffix, label_ids)
        logits = self._label_memo.get(key) if self.prefix_cache else None
        if logits is not None:
            self._label_memo.move_to_end(key)
            reused, evaluated = total, 0
        else:
            self._ensure_prefix(prefix)
            rows, reused, evaluated = self._forward(prefix + [suffix], [total - 1])
            row = rows[total - 1]
            logits = [float(row[t]) for t in label_ids]
            if self.prefix_cache:
                self._label_memo[key] = logits
                while len(self._label_memo) > LABEL_MEMO_SIZE:
                    self._label_memo.popitem(last=False)
        return Distribution(
            option_logits=logits,
            probabilities=softmax(logits),
            tokens=total,
            cached_tokens=reused,
            evaluated_tokens=evaluated,
            scoring="label",
            label_token_ids=label_ids,
            labels=list(label_set.texts[:n]),
        )

    def _answer_tokens(self, question: Question) -> list[list[int]]:
        prefix = self.template.label_prefix
        return [self._tokenize(prefix + text, special=False) or [self.llm.token_eos()] for text in question.answer_texts()]

    def _score_sequence(
        self, question: Question, prefix: list[list[int]], suffix: list[int], answers: list[list[int]]
    ) -> Distribution:
        """Cloze scoring: mean log-probability of each answer's tokens after the prompt. The prompt
        (less its last token) is evaluated once; each answer is one segment: the prompt's last token
        followed by the answer's tokens, with logits at every position."""
        self._ensure_prefix(prefix)
        prompt_len = sum(len(s) for s in prefix) + len(suffix)
        body = prefix + ([suffix[:-1]] if len(suffix) > 1 else [])
        scores, reused_first, evaluated = [], None, 0
        for answer in answers:
            tail = [suffix[-1]] + answer[:-1]
            positions = list(range(prompt_len - 1, prompt_len - 1 + len(tail)))
            rows, reused, n_eval = self._forward(body + [tail], positions)
            reused_first = reused if reused_first is None else reused_first
            evaluated += n_eval
            logprobs = _log_softmax_rows(np.stack([rows[p] for p in positions]))
            total = sum(logprobs[i, t] for i, t in enumerate(answer))
            scores.append(float(total / len(answer)))
        scores = [s if math.isfinite(s) else -1e30 for s in scores]
        return Distribution(
            option_logits=scores,
            probabilities=softmax(scores),
            tokens=prompt_len,
            cached_tokens=reused_first or 0,
            evaluated_tokens=evaluated,
            scoring="sequence",
        )

    def close(self) -> None:
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        self.llm.close()
