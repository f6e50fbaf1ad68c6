"""The scoring engine: one llama.cpp context, a token-prefix cache, and logits read after one forward pass.

Knows llama.cpp, tokens and prompts; knows nothing of HTTP or JSON shapes. Not thread-safe: one
computation at a time (the HTTP layer's admission control guarantees that).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import subprocess
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from .manifest import sha256_file
from .native import NativeDecision, ScoringUnsupported, build_native_plan, read_native_decision
from .plan import (CONTENT_FREE_STATE, DEBIAS_MODES, EngineError, LabelError, PlanError, PromptPlan, PromptTooLong, QuestionPlan, SecondLook,
                   SecondLookUnsupported, TokenBudgetExceeded, _question_tokens, build_plan)
from .prompt import SECOND_LOOK_CUE, SECOND_LOOK_VERSION, Labels, PromptTemplate, Question, TEMPLATE_VERSION, normalise_for_fence
from .results import Cancelled, Distribution, ScoreResult, softmax

__all__ = ["Cancelled", "Distribution", "Engine", "EngineError", "LabelError", "PlanError", "PromptPlan",
           "PromptTooLong", "ScoreResult", "TokenBudgetExceeded", "softmax"]

log = logging.getLogger("semif.engine")

SEQ = 0  # the one sequence this context holds
LABEL_MEMO_SIZE = 256  # identical prompts remembered (label logits only: a few floats each)
# Content-free priors kept (debias "content_free"): one per distinct question and option set, a few floats
# each. A decision service asks a few dozen recurring decisions; an evicted prior is evaluated again.
CONTENT_FREE_ENTRIES = 1024
TEMPLATE_TOKENS_CACHE_SIZE = 1024  # distinct template strings kept tokenized (see Engine._tokenize)
# Only strings up to this many characters are kept there, at most TEMPLATE_TOKENS_CACHE_CHARS in all: template
# pieces are short, and text with client content in it (a question block, options) must not fill memory.
TEMPLATE_TOKENS_MAX_CHARS = 4096
TEMPLATE_TOKENS_CACHE_CHARS = 1 << 20
DEFAULT_PREFIX_CACHE_MB = 256  # SEMIF_PREFIX_CACHE_MB: RAM for KV snapshots of prefixes (0: none)
# A snapshot is restored only when it spares evaluating at least this many tokens: below that, the copy of
# the whole prefix's KV (tens of KB per token) and the extra llama.cpp calls cost about what they save.
PREFIX_SNAPSHOT_MIN_TOKENS = 32
PREFIX_SEEN_SIZE = 4096  # prefix boundaries whose request count is remembered (a hash and a count each)


def _token_logprobs(rows: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """log-softmax(rows[i])[tokens[i]] for each i, computed for those entries only: a logsumexp per row
    (exp in float32 on the raw logits, the sum accumulated in float64), not a float64 copy of every row's
    full log-softmax. The float32 exponentials are within 1e-7 relative of float64 ones, far below any
    difference between answers (logits come out of the model as float32)."""
    peak = rows.max(axis=1)
    sums = np.exp(rows - peak[:, None]).sum(axis=1, dtype=np.float64)
    picked = rows[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)].astype(np.float64)
    return picked - peak.astype(np.float64) - np.log(sums)


def _tokens_digest(parts: Sequence[Sequence[int]], digest=None):
    digest = digest if digest is not None else hashlib.sha256()
    for part in parts:
        digest.update(np.asarray(part, dtype=np.int64).tobytes())
        digest.update(b"|")
    return digest


def _logsumexp(values: Sequence[float]) -> float:
    """log Σ exp(values); -inf when every value is -inf (the model rules them all out), never NaN for that."""
    array = np.asarray(values, dtype=np.float64)
    peak = array.max()
    if not np.isfinite(peak):
        return float(peak)  # -inf: all ruled out; +inf or NaN: passed on for _label_logits to refuse
    return float(peak + np.log(np.exp(array - peak).sum()))


def combine_orders(given: Sequence[float], reversed_: Sequence[float]) -> list[float]:
    """Order debiasing: the average of the two orders' log-probabilities (both indexed by the given
    order), as logits; their softmax is the renormalised combined distribution."""
    first = np.log(np.clip(np.asarray(softmax(given)), 1e-300, None))
    second = np.log(np.clip(np.asarray(softmax(reversed_)), 1e-300, None))
    return ((first + second) / 2).tolist()


CONTENT_FREE_FLOOR = math.log(1e-4)  # the smallest content-free probability divided out (_apply_prior)


class _Priors(NamedTuple):
    """debias "content_free": per question, its prior and whether it was held; tokens evaluated for them."""

    priors: list[list[float]]
    held: list[bool]
    evaluated_tokens: int
    per_question: list[int]  # of those, each question's (its content-free suffix, the prefix with the first)
    # Per question, the index of the option its caller marked as the abstain option (kept: _apply_prior).
    abstain: tuple[Optional[int], ...]
    # Leading prefix tokens the answer shares with the content-free prompt (the template head) that this
    # request's pass decoded, not an earlier request: the answer reused them, but they were not "cached".
    fresh_shared: int = 0


def _log_softmax(logits: Sequence[float]) -> list[float]:
    values = np.asarray(logits, dtype=np.float64)
    return (values - _logsumexp(values)).tolist()


def _abstain_indices(plan: PromptPlan) -> tuple[Optional[int], ...]:
    """Each question's abstain option (an index in the given order), as its caller marked it, or None."""
    return tuple(q.question.abstain for q in plan.questions)


def _with_priors(distributions: list[Distribution], priors: _Priors) -> list[Distribution]:
    """Each answer with its prior divided out. The first answer reused the template head that this request's
    content-free pass decoded: its record counts those tokens as evaluated, as a cold answer's does."""
    out = [_apply_prior(d, p, h, e, a)
           for d, p, h, e, a in zip(distributions, priors.priors, priors.held, priors.per_question, priors.abstain)]
    first_pass = next((i for i, held in enumerate(priors.held) if not held), None)
    if out and priors.fresh_shared and first_pass is not None and out[0].evaluated_tokens > 0:  # not a memo answer
        # Moved, not added: from the first answer's reused tokens to its evaluated ones, and out of the
        # content-free record of the question whose pass decoded them, so the records still add up.
        moved = min(priors.fresh_shared, out[0].cached_tokens, out[first_pass].content_free["evaluated_tokens"])
        out[0].cached_tokens -= moved
        out[0].evaluated_tokens += moved
        out[first_pass].content_free["evaluated_tokens"] -= moved
    return out


def content_free_shift(prior: Sequence[float], abstain: Optional[int] = None) -> np.ndarray:
    """What content-free calibration subtracts from each raw logit.

    Without an abstain option: the content-free log-prior, so that each probability is divided by the option's
    content-free probability (renormalised) and the content-free state itself answers uniformly. A prior below
    CONTENT_FREE_FLOOR counts as the floor: an option the model all but rules out when the state says nothing
    is not made a near-certainty by dividing by almost zero.

    With the caller's abstain option (``abstain``, an index): a content-free state is itself a reason to
    abstain, so that option keeps its content-free share, and only the bias among the other options is divided
    out: on the content-free state the answer is the abstain option's content-free probability, the rest shared
    equally among the others. The abstain option's logit is not shifted; the others are shifted by their log-prior
    less log((1 - p_abstain) / (n - 1)). Measured on labeled decisions: docs/benchmarks.md, "Calibration and
    abstention"."""
    log_prior = np.asarray(prior, dtype=np.float64)
    shift = np.maximum(log_prior, CONTENT_FREE_FLOOR)
    n = len(shift)
    if abstain is None or n < 2:
        return shift
    rest = max(1.0 - softmax(prior)[abstain], math.exp(CONTENT_FREE_FLOOR))
    shift = shift - math.log(rest / (n - 1))
    shift[abstain] = 0.0
    return shift


def _apply_prior(dist: Distribution, prior: Sequence[float], held: bool, evaluated: int = 0,
                 abstain: Optional[int] = None) -> Distribution:
    """Contextual calibration: the raw logits less content_free_shift (each probability divided by the
    option's content-free probability, renormalised; the caller's abstain option keeps its content-free share).
    The raw answer stays in ``content_free``."""
    raw = list(dist.option_logits)
    # An option the answer itself rules out stays ruled out (probability exactly 0), whatever its prior.
    applied = content_free_shift(prior, abstain)
    shifted = np.asarray(raw, dtype=np.float64) - applied
    dist.option_logits = [RULED_OUT_LOGIT if r <= RULED_OUT_LOGIT else float(v) for r, v in zip(raw, shifted)]
    dist.content_free = {"state": CONTENT_FREE_STATE, "prior": softmax(prior), "held": held,
                         "evaluated_tokens": evaluated, "option_logits": raw, "probabilities": dist.probabilities}
    if abstain is not None:
        dist.content_free["abstain_kept"] = abstain
    dist.probabilities = softmax(dist.option_logits)
    dist.debias = "content_free"
    if dist.recompute is not None:
        # The raw logits are recomputed from the segments; the prior, as applied, is subtracted from them.
        dist.recompute = dict(dist.recompute, content_free_log_prior=applied.tolist())
    return dist


def _tokens_key(prefix: Sequence[Sequence[int]], suffix: Sequence[int], label_ids: Sequence[int]) -> bytes:
    return _tokens_digest((suffix, label_ids), _tokens_digest(prefix)).digest()


# The logit reported for a label the model rules out (-inf in every variant): finite, so that JSON can
# carry it, and far below any real logit, so its probability is exactly 0 (as sequence scoring's floor).
RULED_OUT_LOGIT = -1e30


def _label_logits(row: np.ndarray, variants: Sequence[Sequence[int]]) -> tuple[list[float], float]:
    """(one logit per label: the log-sum-exp of its variants' logits, label mass: the share of the
    whole next-token distribution on all the labels' tokens; one log-sum-exp over the vocabulary row).
    A label at -inf in every variant gets RULED_OUT_LOGIT; when every label is, the mass is 0 and the
    probabilities come out uniform. NaN or +inf logits mean a broken model: an EngineError, not an answer."""
    logits = [_logsumexp([float(row[t]) for t in v]) if len(v) > 1 else float(row[v[0]]) for v in variants]
    total = _logsumexp(row)
    if any(math.isnan(x) or x == math.inf for x in logits) or not math.isfinite(total):
        raise EngineError(f"the model produced non-finite logits at the answer position (vocabulary log-sum-exp {total}, "
                          f"label logits {[round(x, 3) for x in logits]}); this GGUF cannot be scored")
    mass = float(np.exp(_logsumexp(logits) - total)) if logits else 0.0
    return [x if x != -math.inf else RULED_OUT_LOGIT for x in logits], min(1.0, mass)


DEFAULT_N_CTX_CAP = 8192  # what SEMIF_N_CTX defaults to at most: System One's 255 described options need ~4.7k
FALLBACK_N_CTX = 4096  # a model that does not say its training context


def default_n_ctx(model_path: str | os.PathLike) -> int:
    """The context size when SEMIF_N_CTX is unset: the model's training context, capped at 8192
    (enough for the largest standard requests; a bigger context only costs memory). Read from the
    GGUF header of a vocabulary-only load: no weights are read."""
    import llama_cpp
    from llama_cpp._utils import suppress_stdout_stderr

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with suppress_stdout_stderr(disable=False):  # llama.cpp prints its loader log otherwise
        model = llama_cpp.llama_model_load_from_file(str(model_path).encode("utf-8"), params)
    if not model:
        return FALLBACK_N_CTX
    try:
        buf = ctypes.create_string_buffer(256)
        trained = 0
        if llama_cpp.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf)) > 0:
            key = buf.value + b".context_length"
            if llama_cpp.llama_model_meta_val_str(model, key, buf, len(buf)) > 0 and buf.value.isdigit():
                trained = int(buf.value)
    finally:
        llama_cpp.llama_model_free(model)
    return min(trained, DEFAULT_N_CTX_CAP) if trained > 0 else FALLBACK_N_CTX


def _ggml_type_name(value: int) -> str:
    """The KV cache element type's name ("f16"), from llama_cpp's GGML_TYPE_* constants."""
    import llama_cpp

    for name in dir(llama_cpp):
        if name.startswith("GGML_TYPE_") and getattr(llama_cpp, name) == value:
            return name[len("GGML_TYPE_"):].lower()
    return str(value)


def recompute_segments(segments: Sequence[Sequence[int]], start: int = 0) -> list[dict]:
    """Segments as the recompute record lists them: each one's first position and tokens (the first at ``start``)."""
    out, pos = [], start
    for segment in segments:
        out.append({"pos": pos, "tokens": [int(t) for t in segment]})
        pos += len(segment)
    return out


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


@dataclass
class _PrefixSnapshot:
    """The KV of one sequence holding exactly ``segments`` (llama_state_seq_get_data's bytes)."""

    segments: tuple[tuple[int, ...], ...]
    n_tokens: int
    data: np.ndarray  # uint8


class _TokenCache:
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


def _prefix_key(segments: Sequence[Sequence[int]]) -> int:
    return hash(tuple(tuple(s) for s in segments))


class Engine:
    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        n_ctx: Optional[int] = None,
        n_batch: int = 512,
        n_threads: Optional[int] = None,
        n_gpu_layers: int = -1,
        prefix_cache: bool = True,
        label_memo: bool = True,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
        flash_attn: bool = True,
        default_scoring: str = "label",
        model_sha256: Optional[str] = None,
        verbose: bool = False,
        n_seq: int = 1,
        content_free_entries: int = CONTENT_FREE_ENTRIES,
    ):
        import llama_cpp  # imported here so the HTTP layer and tools import without a compiled library

        self._lc = llama_cpp
        self.model_path = Path(model_path)
        self.prefix_cache = prefix_cache
        self.label_memo = label_memo
        self.default_scoring = default_scoring
        self.sha256 = model_sha256 or sha256_file(self.model_path)
        started = time.perf_counter()
        if n_ctx is None:
            n_ctx = default_n_ctx(self.model_path)
        self.llm = llama_cpp.Llama(
            model_path=str(self.model_path),
            n_ctx=n_ctx,
            # Rewinding a sliding-window-attention cache to an earlier position is exact only while the
            # cache keeps every position (llama.cpp's full-size SWA cache). It is the vendored default
            # today; set it explicitly so an upgrade cannot change it under the prefix cache.
            swa_full=True,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_gpu_layers=n_gpu_layers,
            # llama-server's default is "auto" (on wherever the backend supports it, the CPU included);
            # llama-cpp-python can only force it on or off. On unless SEMIF_FLASH_ATTN=0, as in llama-server:
            # 4-11% faster per decision on this CPU, more the longer the prompt (docs/benchmarks.md). The
            # CPU kernel accumulates in half precision, so the same prompt evaluated in other batch shapes
            # differs by ~0.2 logit instead of ~0.002; the engine's shapes are fixed by the request, so a
            # cached answer still equals an uncached one. Every answer's model record names it (`flash_attn`).
            flash_attn=flash_attn,
            logits_all=False,
            verbose=verbose,
        )
        # Opt-in parallel sequences (SEMIF_BATCHING): the serial path below only ever uses sequence 0.
        from .batching import BatchStats, enable_parallel_sequences

        if n_seq > 1:
            enable_parallel_sequences(self.llm, n_seq, verbose=verbose)
        self.n_seq = n_seq
        self.batch_stats = BatchStats()
        self.load_s = time.perf_counter() - started
        self.n_ctx = self.llm.n_ctx()
        self.n_batch = n_batch
        self.n_vocab = self.llm.n_vocab()
        self._ctx = self.llm._ctx.ctx
        self._model = self.llm._model.model
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        # Template text tokens by (text, add_bos). Bounded by entries (label selection at load tokenizes some
        # hundreds of cue + label strings) and by characters: only short strings are kept (see _TokenCache).
        self._template_tokens = _TokenCache(
            lambda text, add_bos: self._tokenize_bytes(text.encode("utf-8"), add_bos, True),
            max_entries=TEMPLATE_TOKENS_CACHE_SIZE, max_chars=TEMPLATE_TOKENS_MAX_CHARS,
            max_total_chars=TEMPLATE_TOKENS_CACHE_CHARS,
        )
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        # Recurrent and hybrid models cannot drop the tail of a sequence; they rewind by restoring a
        # per-sequence snapshot taken at the end of the state prefix, or else re-evaluate from scratch.
        self.partial_rewind = not (
            llama_cpp.llama_model_is_recurrent(self._model) or llama_cpp.llama_model_is_hybrid(self._model)
        )
        self.n_swa = int(llama_cpp.llama_model_n_swa(self._model))
        self.snapshot_restores = 0  # llama_state_seq_set_data calls that restored the state prefix
        # More than one prefix stays warm: KV snapshots of prefixes in RAM, least recently used dropped
        # first, at most prefix_cache_mb in all (see _use_prefix_snapshots).
        self.prefix_cache_bytes = int(max(0.0, prefix_cache_mb) * (1 << 20))
        self._prefix_snapshots: "OrderedDict[int, _PrefixSnapshot]" = OrderedDict()
        self._prefix_snapshot_bytes = 0
        self._prefix_seen: "OrderedDict[int, int]" = OrderedDict()  # prefix key -> requests that planned it
        self.prefix_snapshots_taken = 0
        self.prefix_restores = 0  # snapshots restored instead of evaluating their tokens
        self.prefix_restored_tokens = 0
        self.prefix_snapshot_failures = 0  # saves or restores that raised or were refused (answered cold instead)
        self._decoded_from: Optional[int] = None  # lowest position decoded in the current request
        # The current request's cancel hook, asked before each question and, within one, before any batch
        # that would make more than n_batch tokens decoded since it was last asked (a long state);
        # (question index, questions) for the Cancelled raised there.
        self._cancel: Optional[Callable[[], bool]] = None
        self._cancel_progress = (0, 0)
        self._unchecked_tokens = 0
        self._decoded_tokens = 0  # all tokens the serial path decoded: what a pass stopped part-way spent
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self._batch_seq_ready = False  # n_seq_id / seq_id of every batch slot hold (1, SEQ): _fill_batch
        self._segments: list[tuple[int, ...]] = []  # what the context holds, in evaluation segments
        # Of those, how many leading segments the serial path evaluated itself (or restored from its own
        # snapshots). The rest came out of a batched decode (batching.py), in other batch shapes: the
        # batched path may reuse them, the serial path, its label memo and its snapshots never do.
        self._serial_segments = 0
        # Label logits of recently scored prompts, keyed by their exact tokens: an identical question
        # about an identical state is answered with the logits it already produced (exact by construction).
        self._label_memo: "OrderedDict[bytes, tuple[list[float], float]]" = OrderedDict()
        self.default_debias = "none"  # SEMIF_DEBIAS (serve sets it); a request's `debias` overrides it
        # debias "content_free": each question's prior (log-probabilities over its labels, in shown order),
        # keyed by the content-free prompt's exact tokens and label variants (_content_free_priors).
        self.content_free_entries = max(1, int(content_free_entries))
        self._content_free: "OrderedDict[bytes, list[float]]" = OrderedDict()
        self.content_free_passes = 0  # content-free plans evaluated (the others were answered from held priors)
        self._memo_prefix: Optional[tuple[list, "hashlib._Hash"]] = None  # (prefix list, its digest): _memo_key
        self._record_prefix: Optional[tuple[list, list[dict]]] = None  # (prefix list, its records): _record_segments
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
        # Turn markers this template writes as plain text for this vocabulary: escaped inside every state.
        self.template.detect_plain_markers(self._tokenize)
        normalise_for_fence("\u00e9")  # builds the format-character table now, not in the first request
        self.end_of_turn_token = self._end_of_turn_token()
        # A GGUF made for decisions brings its own template, labels and temperatures (semif/serving/engine/native.py).
        self.native: Optional[NativeDecision] = read_native_decision(
            metadata, lambda text, special, add_bos=False: self._tokenize(text, special=special, add_bos=add_bos),
            n_vocab=self.n_vocab,
        )
        if self.native is not None:
            self.default_scoring = "label"  # a native model is read at its labels
        self.n_gpu_layers = n_gpu_layers if llama_cpp.llama_supports_gpu_offload() else 0
        self.info = {
            "file": self.model_path.name,
            "sha256": self.sha256,
            "architecture": metadata.get("general.architecture"),
            "llama_cpp_python": llama_cpp.__version__,
            "llama_cpp_build": self._llama_build(),
            "n_gpu_layers": self.n_gpu_layers,
            "flash_attn": bool(flash_attn),
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
            "hardware": (_gpu_name() if llama_cpp.llama_supports_gpu_offload() else None) or _cpu_name(),
            "n_ctx": self.n_ctx,
            "n_swa": self.n_swa,
            "chat_template": self.template.chat_template is not None,
            "template_version": TEMPLATE_VERSION,
            "template_sha256": self.template.sha256,
            "max_label_options": len(self.labels.letters.texts),
            "plain_turn_markers": list(self.template.plain_markers),
            "thinking": self.template.thinking,
            "end_of_turn_token": self._piece(self.end_of_turn_token),
            "native_decision": None,
        }
        # The context settings that change a logit (recorded in every recompute record). Threads do not:
        # llama.cpp's CPU kernels split whole rows between threads (tests/test_recompute.py checks it).
        self.numerics = {
            "n_ctx": self.n_ctx,
            "n_batch": n_batch,
            "n_ubatch": n_batch,
            "flash_attn": bool(flash_attn),
            "type_k": _ggml_type_name(self.llm.context_params.type_k),
            "type_v": _ggml_type_name(self.llm.context_params.type_v),
            "swa_full": True,
            "n_gpu_layers": self.n_gpu_layers,
        }
        if self.native is not None:
            self.info.update(template_version=self.native.template_version, template_sha256=self.native.sha256,
                             native_decision=self.native.describe(), max_label_options=self.native.describe()["labels"])
            log.info("native decision model: its own template, labels and temperatures are used",
                     extra={"native_decision": self.native.describe()})

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
        if special:
            # Text that may hold special tokens is template text, a few constant strings per template (head,
            # tail), tokenized once each instead of once per question. Plans also tokenize client text this
            # way (to see whether special tokens change it): long strings are not kept (_TokenCache).
            return list(self._template_tokens(text, add_bos))
        return self._tokenize_bytes(text.encode("utf-8"), add_bos, False)

    def _tokenize_bytes(self, data: bytes, add_bos: bool, special: bool, n_max: Optional[int] = None) -> list[int]:
        """llama_tokenize into a buffer sized from the text. (llama-cpp-python's Llama.tokenize allocates
        and zeroes n_ctx_train tokens per call: 32 KB for SmolLM2, 512 KB for Llama-3.1.) A token covers at
        least one byte, so bytes + a few (BOS/EOS, a SentencePiece space prefix) is enough; llama.cpp
        answers minus the size it needs when it is not, and the call is repeated with that size."""
        lc = self._lc
        n_max = len(data) + 4 if n_max is None else n_max
        buf = (lc.llama_token * n_max)()
        n = lc.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_bos, special)
        if n < 0:
            n_max = -n
            buf = (lc.llama_token * n_max)()
            n = lc.llama_tokenize(self._vocab, data, len(data), buf, n_max, add_bos, special)
            if n < 0:
                raise EngineError(f"llama_tokenize failed ({n}) on {len(data)} bytes")
        return np.frombuffer(buf, dtype=np.int32, count=n).tolist()

    def _end_of_turn_token(self) -> int:
        """The token that ends an answer under sequence scoring: with a chat template, the first
        end-of-generation token it writes after an assistant reply (``<|im_end|>`` for ChatML), else the
        vocabulary's end-of-turn token; without one (plain layout, no turns) end-of-sequence."""
        if self.template.chat_template is None:
            return int(self.llm.token_eos())
        vocab = self._lc.llama_model_get_vocab(self._model)
        for token in self._tokenize(self.template.end_of_turn_text(), special=True):
            if self._lc.llama_vocab_is_eog(vocab, token):
                return int(token)
        eot = int(self._lc.llama_vocab_eot(vocab))
        return eot if eot >= 0 else int(self.llm.token_eos())

    def _llama_build(self) -> str:
        for name in ("llama_build_number", "LLAMA_BUILD_NUMBER"):
            value = getattr(self._lc, name, None)
            if value is not None:
                return str(value() if callable(value) else value)
        return f"llama-cpp-python-{self._lc.__version__}"

    def plan(
        self,
        state_text: str,
        questions: Sequence[Question],
        *,
        scoring: Optional[str] = None,
        return_prompt: bool = False,
        state_field: str = "state",
        question_fields: Optional[Sequence[str]] = None,
        question_names: Optional[Sequence[str]] = None,
        budget_field: str = "questions",
        max_request_tokens: Optional[int] = None,
        layout: str = "state_first",
        injection_check: bool = False,
        layout_field: str = "layout",
        debias: Optional[str] = None,
        second_look: Optional[SecondLook] = None,
        second_look_field: str = "second_look",
        default_debias: Optional[str] = None,
        injection_check_field: str = "injection_check",
    ) -> PromptPlan:
        """Everything per request that does not need the context: fencing, tokens, labels, length and
        budget checks. Safe to call from any thread while the model thread computes: llama.cpp's
        tokenizer only reads the vocabulary. ``layout`` and ``injection_check``: see plan.build_plan.
        ``second_look``: see plan.SecondLook (label scoring only; its worst case counts in the budget).

        A request over the token budget (``max_request_tokens``) is refused naming what pushed it over: the
        questions (``budget_field``), then, in this order, each addition that does not fit on top of them: the
        injection checks (``injection_check_field``), debias 'content_free' (``debias``, or ``budget_field``
        under the server default), the second look (``second_look_field``)."""
        if second_look is not None:
            # Everything but the second look is planned, and refused, as without it.
            planned = self.plan(state_text, questions, scoring=scoring, return_prompt=return_prompt,
                                state_field=state_field, question_fields=question_fields,
                                question_names=question_names, budget_field=budget_field,
                                max_request_tokens=max_request_tokens, layout=layout, injection_check=injection_check,
                                layout_field=layout_field, debias=debias, default_debias=default_debias,
                                injection_check_field=injection_check_field)
            if planned.scoring != "label" or self.native is not None:
                raise SecondLookUnsupported("the second look reads labels: it needs label scoring on a chat model",
                                            field=second_look_field)
            # Worst case: every question looks again with the whole budget: its second-look suffix, the
            # reasoning, the answer cue and, options-first (the state is the last prefix segment, merged with
            # the first pass's suffix), the whole prefix once more.
            cue = len(self._tokenize(SECOND_LOOK_CUE, special=False))
            again = sum(len(s) for s in planned.prefix_segments) if planned.layout == "options_first" else 0
            suffixes = tuple(self._second_look_suffix(planned, q) for q in planned.questions)
            extra = sum(len(s) + second_look.max_tokens + cue + again for s in suffixes)
            extra += self._prefix_after_checks(planned)
            planned = replace(planned, second_look=second_look, second_look_tokens=extra,
                              second_look_suffixes=suffixes)
            if max_request_tokens is not None and planned.worst_case_tokens > max_request_tokens:
                over = TokenBudgetExceeded(planned.worst_case_tokens, max_request_tokens, field=second_look_field)
                over.args = (f"{over}; the second look counts, per question, its reasoning budget "
                             f"({second_look.max_tokens} tokens) and its own prompt: ask for fewer reasoning tokens, "
                             "or leave the second look out",)
                raise over
            return planned
        scoring = scoring or self.default_scoring
        if scoring not in ("label", "sequence"):
            raise EngineError(f"unknown scoring method {scoring!r}", field="scoring")
        by_default = debias is None
        if by_default:
            # The server's default (``default_debias``, else SEMIF_DEBIAS as serve set it) applies where it can:
            # content_free reads label probabilities, so cloze scoring and native decision models keep "none"
            # unless the request asks for it (then they are refused, naming the field).
            debias = default_debias or getattr(self, "default_debias", "none")
            if debias == "content_free" and (scoring != "label" or self.native is not None):
                debias = "none"
        if debias not in DEBIAS_MODES:
            raise PlanError(f"unknown debias mode {debias!r}; use one of {', '.join(DEBIAS_MODES)}", field="debias")
        if self.native is not None:
            if scoring != "label":
                raise ScoringUnsupported("this model is a native decision model, read at its own labels: scoring must be 'label'",
                                         field="scoring")
            # The model's own template decides the layout and has no place for our restatement or checks.
            if layout != "state_first":
                raise PlanError("this model is a native decision model with its own prompt template: layout must be "
                                "'state_first'", field=layout_field)
            if debias != "none":
                raise PlanError("this model is a native decision model with its own prompt template: debias must be "
                                "'none'", field="debias")
            if injection_check:
                raise PlanError("this model is a native decision model with its own prompt template: the injection "
                                "check is not available", field="injection_check")
            return build_native_plan(
                native=self.native, tokenize=self._tokenize, n_ctx=self.n_ctx, n_batch=self.n_batch,
                state_text=state_text, questions=questions, state_field=state_field,
                question_fields=question_fields, question_names=question_names, budget_field=budget_field,
                max_request_tokens=max_request_tokens, return_prompt=return_prompt,
            )
        common = dict(
            template=self.template, labels=self.labels, tokenize=self._tokenize,
            eos_token=self.llm.token_eos(), bos_token=self.llm.token_bos(), adds_bos=self._adds_bos(),
            n_ctx=self.n_ctx, n_batch=self.n_batch, questions=questions, scoring=scoring,
            question_fields=question_fields, question_names=question_names, budget_field=budget_field,
            layout=layout, layout_field=layout_field, end_of_turn_token=self.end_of_turn_token,
            injection_check_field=injection_check_field, partial_rewind=self.partial_rewind,
        )
        if debias == "reverse":
            try:
                return build_plan(**common, state_text=state_text, state_field=state_field,
                                  max_request_tokens=max_request_tokens, return_prompt=return_prompt,
                                  injection_check=injection_check, debias=debias)
            except TokenBudgetExceeded as over:
                if over.field != budget_field:
                    raise  # the injection checks pushed it over: named as such
                # Over the budget with the reversed order: refused naming what pushed it over when the questions
                # alone fit (never answered in one order only).
                alone = build_plan(**common, state_text=state_text, state_field=state_field, max_request_tokens=None,
                                   return_prompt=False, injection_check=False, debias="none")
                if alone.worst_case_tokens <= max_request_tokens:
                    blamed = TokenBudgetExceeded(over.tokens, over.budget, field=budget_field if by_default else "debias")
                    blamed.args = (f"{over}; with debias 'reverse'{' (the server default)' if by_default else ''} that "
                                   "counts each question in both option orders: send debias 'none' to leave it out",)
                    raise blamed from None
                raise
        if debias != "content_free":
            return build_plan(**common, state_text=state_text, state_field=state_field,
                              max_request_tokens=max_request_tokens, return_prompt=return_prompt,
                              injection_check=injection_check, debias=debias)
        if scoring != "label":
            raise PlanError("debias 'content_free' reads each option's label probability: it needs label scoring",
                            field="debias")
        planned = build_plan(**common, state_text=state_text, state_field=state_field, max_request_tokens=max_request_tokens,
                             return_prompt=return_prompt, injection_check=injection_check, debias=debias)
        try:
            content_free = build_plan(**common, state_text=CONTENT_FREE_STATE, state_field="debias",
                                      max_request_tokens=None, return_prompt=False, injection_check=False, debias="none")
        except PromptTooLong as too_long:
            # Refused, by default too: an answer is never given at another calibration than asked.
            raise PromptTooLong(too_long.tokens, too_long.n_ctx, field="debias",
                                what="the content-free prompt (debias 'content_free'; send debias 'none' to leave it out)"
                                ) from None
        # The prior is read the way the answer is: one segment for state and question where the answer is.
        content_free = replace(content_free, fuse_state_and_question=planned.fuse_state_and_question)
        # The budget counts one content-free prompt per distinct question, whether its prior is held or not: what a
        # request may do depends on the request alone, never on what ran before (a held prior still saves the
        # compute: the plan keeps it, so it is used even if evicted before execution). Copies of one question share
        # one prior.
        held, distinct = [], {}
        for qplan in content_free.questions:
            key = self._content_free_key(content_free, qplan)
            prior = self._content_free.get(key)
            held.append(tuple(prior) if prior is not None else None)
            distinct.setdefault(key, qplan.worst_case_tokens)
        planned = replace(planned, content_free=content_free, content_free_held=tuple(held),
                          content_free_tokens=content_free.state_tokens + sum(distinct.values()) if distinct else 0)
        if max_request_tokens is not None and planned.worst_case_tokens > max_request_tokens:
            # Refused, never answered at another calibration: the answer would depend on its neighbours.
            over = TokenBudgetExceeded(planned.worst_case_tokens, max_request_tokens,
                                       field=budget_field if by_default else "debias")
            over.args = (f"{over}; with debias 'content_free'{' (the server default)' if by_default else ''} that "
                         f"counts the content-free prompt of each distinct question ({len(distinct)} here): send "
                         "debias 'none' to leave it out",)
            raise over
        return planned

    def _prefix_after_checks(self, plan: PromptPlan) -> int:
        """Prefix tokens the second look evaluates again because state-first injection checks ran before it:
        each check's own prefix (its question, then the state) replaced the request's in the context, so the
        first second look evaluates the request's prefix again, less the leading segments the check's prefix
        shares with it (the template head) where the context keeps them (_rewind); the looks after it reuse it."""
        own = [c for c in plan.injection_checks if c.own_prefix_segments is not None]
        if plan.layout != "state_first" or not own:
            return 0
        kept = 0
        if self.partial_rewind:
            for mine, theirs in zip(plan.prefix_segments, own[-1].own_prefix_segments):
                if mine != theirs:
                    break
                kept += len(mine)
        return plan.state_tokens - kept

    def prefix_segments(self, state_text: str) -> tuple[str, list[list[int]]]:
        """The state prefix as evaluation segments (see ``plan``): the template head, then the fenced
        state in blocks of ``n_batch`` tokens."""
        planned = self.plan(state_text, [])
        return planned.prefix_text, [list(s) for s in planned.prefix_segments]

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
        # Attention caches: metadata only. The cells are marked free and llama.cpp masks free cells out of
        # attention (weight exactly 0; flash attention skips them), so what stays in the buffer never
        # reaches a result; zeroing it would be a memset of the whole KV cache (~90 MB for SmolLM2 at 4096
        # tokens) on every request with the prefix cache off. Recurrent states: cleared with their data.
        self._lc.llama_memory_clear(self._memory, not self.partial_rewind)
        self._segments = []
        self._serial_segments = 0
        self._snapshot = None
        if not (self.prefix_cache and self.label_memo):
            self._label_memo.clear()

    def _rewind(self, n_segments: int) -> None:
        """Keep the first ``n_segments`` segments in the context, drop the rest."""
        if n_segments >= len(self._segments):
            return
        n_keep = sum(len(s) for s in self._segments[:n_segments])
        if self.partial_rewind and self._lc.llama_memory_seq_rm(self._memory, SEQ, n_keep, -1):
            self._segments = self._segments[:n_segments]
            self._serial_segments = min(self._serial_segments, n_segments)
            return
        snap = self._snapshot
        if snap is not None and len(snap[0]) <= n_segments and self._segments[: len(snap[0])] == snap[0]:
            self._lc.llama_memory_seq_rm(self._memory, SEQ, -1, -1)  # removing a whole sequence never fails
            buf = snap[1]
            if self._lc.llama_state_seq_set_data(self._ctx, buf, len(buf), SEQ) == 0:
                self.invalidate()
                return
            self.snapshot_restores += 1
            self._segments = list(snap[0])
            self._serial_segments = len(self._segments)  # taken by _ensure_prefix, on the serial path
            return
        self.invalidate()

    def _take_snapshot(self) -> None:
        size = self._lc.llama_state_seq_get_size(self._ctx, SEQ)
        buf = (ctypes.c_uint8 * size)()
        written = self._lc.llama_state_seq_get_data(self._ctx, buf, size, SEQ)
        self._snapshot = (list(self._segments), buf) if written else None

    def _fill_batch(self, chunk: np.ndarray, first: int, want: set[int]) -> int:
        """Put ``chunk`` (int32 tokens at positions first, first+1, …) into the batch, all in sequence SEQ,
        logits at the positions in ``want``: whole-array copies, not a Python loop over tokens. The
        per-token sequence ids live in arrays llama_batch_init allocates one by one; they are written
        once, at the first fill (``_batch_seq_ready``: whoever writes other ids into this batch clears it)."""
        batch, n = self._batch, len(chunk)
        batch.n_tokens = n
        positions = np.arange(first, first + n, dtype=np.int32)
        flags = np.zeros(n, dtype=np.int8)
        for pos in want:
            if first <= pos < first + n:
                flags[pos - first] = 1
        ctypes.memmove(batch.token, chunk.ctypes.data, n * 4)
        ctypes.memmove(batch.pos, positions.ctypes.data, n * 4)
        ctypes.memmove(batch.logits, flags.ctypes.data, n)
        if not self._batch_seq_ready:
            ones = np.ones(self.n_batch, dtype=np.int32)  # a name, so it outlives the copy
            ctypes.memmove(batch.n_seq_id, ones.ctypes.data, self.n_batch * 4)
            for i in range(self.n_batch):
                batch.seq_id[i][0] = SEQ
            self._batch_seq_ready = True
        return n

    def _decode(self, tokens: Sequence[int], want: set[int]) -> dict[int, np.ndarray]:
        """Append one segment to the context; return the logits rows at the absolute positions in ``want``."""
        lc, batch = self._lc, self._batch
        rows: dict[int, np.ndarray] = {}
        start = self._cached_len
        if self._decoded_from is None or start < self._decoded_from:
            self._decoded_from = start
        all_tokens = np.asarray(tokens, dtype=np.int32)
        for offset in range(0, len(all_tokens), self.n_batch):
            # At most n_batch tokens decoded between two questions of the cancel hook.
            if self._cancel is not None and self._unchecked_tokens + min(self.n_batch, len(all_tokens) - offset) > self.n_batch:
                self._unchecked_tokens = 0
                if self._cancel():
                    self._drop_partial_segment(start)
                    raise Cancelled(*self._cancel_progress)
            first = start + offset
            n = self._fill_batch(all_tokens[offset : offset + self.n_batch], first, want)
            status = lc.llama_decode(self._ctx, batch)
            if status != 0:
                self.invalidate()
                raise EngineError(f"llama_decode failed with status {status}")
            self._unchecked_tokens += n
            self._decoded_tokens += n
            for pos in sorted(p for p in want if first <= p < first + n):
                ptr = lc.llama_get_logits_ith(self._ctx, pos - first)
                rows[pos] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
        if self._serial_segments == len(self._segments):
            self._serial_segments += 1
        self._segments.append(tuple(tokens))
        return rows

    def _drop_partial_segment(self, start: int) -> None:
        """A segment stopped before or between its batches: drop its cells from ``start`` on, so the context
        holds exactly its complete segments (or nothing, where it cannot rewind partially). The segment
        was never recorded, so no snapshot and no memo entry holds it."""
        if not (self.partial_rewind and self._lc.llama_memory_seq_rm(self._memory, SEQ, start, -1)):
            self.invalidate()

    def _forward(self, segments: list[Sequence[int]], positions: list[int]) -> tuple[dict[int, np.ndarray], int, int]:
        """Logits at absolute ``positions`` (all inside the last segment), reusing the longest run of
        leading segments the context already holds. Returns (rows, reused tokens, evaluated tokens)."""
        total = sum(len(s) for s in segments)
        if total > self.n_ctx:
            raise PromptTooLong(total, self.n_ctx)
        keep = 0
        limit = len(segments) - 1  # the segment whose logits we need is always evaluated
        # Only segments the serial path evaluated are reused: a prefix decoded in a batch is evaluated again.
        while keep < min(limit, self._serial_segments) and self._segments[keep] == tuple(segments[keep]):
            keep += 1
        if self._prefix_snapshots_enabled:
            keep = self._use_prefix_snapshots(segments, keep, limit)
        self._rewind(keep)
        keep = len(self._segments)
        reused = self._cached_len
        rows: dict[int, np.ndarray] = {}
        want = set(positions)
        for segment in segments[keep:]:
            rows.update(self._decode(segment, want))
        return rows, reused, total - reused

    # ---- several sequences (the opt-in batched path, batching.py) ---------------------------------
    #
    # The batched step works on the same context through these methods only: the segment bookkeeping,
    # the batch and the KV memory stay the engine's. Sequence SEQ (0) is the one the serial path uses;
    # the batched step borrows sequences 1…n_seq-1 for one step and hands them back empty.

    def held_segments(self) -> tuple[tuple[int, ...], ...]:
        """The segments sequence SEQ holds, in order: what the next step can reuse."""
        return tuple(self._segments)

    def keep_segments(self, n_segments: int) -> int:
        """Keep the first ``n_segments`` held segments and drop the rest; return how many are still held
        (none when the context could not rewind partially and was emptied)."""
        self._rewind(n_segments)
        return len(self._segments)

    def copy_sequence(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Give sequence ``dst`` the cells of ``src`` at positions [p0, p1) (shared, in a unified KV buffer)."""
        self._lc.llama_memory_seq_cp(self._memory, src, dst, p0, p1)

    def decode_entries(self, entries: Sequence[tuple[int, int, int, Optional[int]]],
                       wanted: dict[int, list[list[int]]]) -> dict[int, tuple[list[float], float]]:
        """Decode (token, position, sequence, tag) entries in order, ``n_batch`` at a time; return the label
        logits and label mass (``wanted[tag]``: each label's token variants) at each tagged entry."""
        lc, batch, ctx = self._lc, self._batch, self._ctx
        # Other sequence ids go into the batch: the serial fill must write its own again.
        self._batch_seq_ready = False
        out: dict[int, tuple[list[float], float]] = {}
        for offset in range(0, len(entries), self.n_batch):
            chunk = entries[offset : offset + self.n_batch]
            batch.n_tokens = len(chunk)
            for i, (token, pos, seq, tag) in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = tag is not None
            status = lc.llama_decode(ctx, batch)
            if status != 0:
                self.invalidate()
                raise EngineError(f"llama_decode failed with status {status} (batched, {len(chunk)} tokens)")
            for i, (_, _, _, tag) in enumerate(chunk):
                if tag is not None:
                    row = np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(self.n_vocab,))
                    out[tag] = _label_logits(row, wanted[tag])
        return out

    def settle_sequences(self, seq: int, segments: Sequence[Sequence[int]], n_used: int) -> None:
        """After a batched step: sequence SEQ keeps ``segments`` (a prefix that sequence ``seq`` holds),
        and sequences 1…n_used-1 are emptied, so the serial path and the next step start from SEQ alone."""
        lc, memory = self._lc, self._memory
        n_tokens = sum(len(s) for s in segments)
        lc.llama_memory_seq_rm(memory, seq, n_tokens, -1)
        if seq != SEQ:
            lc.llama_memory_seq_rm(memory, SEQ, -1, -1)
            lc.llama_memory_seq_cp(memory, seq, SEQ, -1, -1)
        for other in range(1, n_used):  # SEQ is 0: every borrowed sequence, ``seq`` included
            lc.llama_memory_seq_rm(memory, other, -1, -1)
        kept = [tuple(segment) for segment in segments]
        # The leading segments sequence SEQ held before the step, from the serial path, are still those
        # cells (the step shares them; it decoded only what came after); everything else is the batch's.
        serial = 0
        while serial < min(self._serial_segments, len(kept)) and self._segments[serial] == kept[serial]:
            serial += 1
        self._segments = kept
        self._serial_segments = serial

    # ---- prefix snapshots (more than one prefix warm) --------------------------------------------
    #
    # The context holds one prefix; requests that alternate between prefixes (two routing tasks, two busy
    # states) would evict each other. So a prefix boundary that two requests have planned ("hot") is copied
    # out of the context (llama_state_seq_get_data) when it is about to be dropped, and copied back
    # (llama_state_seq_set_data) when a later request starts with it and that spares at least
    # PREFIX_SNAPSHOT_MIN_TOKENS of evaluation. Exact by construction: a snapshot is taken at a segment
    # boundary, of KV that was evaluated segment by segment like any other, and it comes back into the
    # same cells (the sequence is emptied first, so llama.cpp places it from cell 0, where an evaluation
    # puts it too); tests compare restored against evaluated logits. Only for models that rewind partially
    # (the others keep their one per-request snapshot, _ensure_prefix).

    @property
    def _prefix_snapshots_enabled(self) -> bool:
        # Not on sliding-window models: a sequence's state restored into llama.cpp's SWA cache answers up
        # to 0.03 in probability away from the same prefix evaluated (Gemma 3, tests/test_gemma_swa.py),
        # while rewinds stay exact there; such a model keeps one prefix warm, exactly.
        return self.prefix_cache and self.partial_rewind and self.n_swa == 0 and self.prefix_cache_bytes > 0

    @property
    def prefix_snapshot_stats(self) -> dict:
        return {
            "entries": len(self._prefix_snapshots),
            "bytes": self._prefix_snapshot_bytes,
            "limit_bytes": self.prefix_cache_bytes if self._prefix_snapshots_enabled else 0,
            "taken": self.prefix_snapshots_taken,
            "restores": self.prefix_restores,
            "restored_tokens": self.prefix_restored_tokens,
            "failures": self.prefix_snapshot_failures,
        }

    def clear_prefix_snapshots(self) -> None:
        self._prefix_snapshots.clear()
        self._prefix_snapshot_bytes = 0
        self._prefix_seen.clear()

    def _note_prefix(self, prefix: Sequence[Sequence[int]]) -> None:
        """Count one more request for every leading boundary of this request's prefix (under options_first
        the boundary after the question block is the one routing requests share; under state_first, the
        whole state prefix)."""
        if not self._prefix_snapshots_enabled:
            return
        seen = self._prefix_seen
        for m in range(1, len(prefix) + 1):
            key = _prefix_key(prefix[:m])
            seen[key] = seen.get(key, 0) + 1
            seen.move_to_end(key)
        while len(seen) > PREFIX_SEEN_SIZE:
            seen.popitem(last=False)

    def _use_prefix_snapshots(self, segments: list[Sequence[int]], keep: int, limit: int) -> int:
        """Before the context drops what it holds beyond ``keep`` segments: save its deepest hot prefix,
        then restore the deepest snapshot that starts ``segments`` (within the first ``limit``) if that
        spares enough evaluation. Returns how many leading segments of ``segments`` the context now holds
        (or ``keep``, for the caller's rewind). A save or restore that fails leaves the context empty
        (0): the request is then evaluated cold, as if no snapshot had existed."""
        keep_tokens = sum(len(s) for s in segments[:keep])
        found: Optional[_PrefixSnapshot] = None
        n_tokens = keep_tokens
        for m in range(keep + 1, limit + 1 if self._prefix_snapshots else 0):  # deepest wins
            n_tokens += len(segments[m - 1])
            if n_tokens - keep_tokens < PREFIX_SNAPSHOT_MIN_TOKENS:
                continue
            entry = self._prefix_snapshots.get(_prefix_key(segments[:m]))
            if entry is not None and entry.segments == tuple(tuple(s) for s in segments[:m]):
                found = entry
        if found is not None:
            # Out of the cache before the save below, which may evict the least recently used snapshot:
            # with room for one, that is exactly the one about to be restored. Once restored it is what
            # the context holds, so the context, not the cache, keeps it warm (see _keep_restored).
            self._drop_snapshot(_prefix_key(found.segments))
        if keep < len(self._segments):
            try:
                self._save_prefix(keep)
            except Exception:
                self._snapshot_failed("save")
                keep = 0
        if found is None:
            return keep
        restored = self._restore_prefix(found)
        if restored:
            self._keep_restored(found)
        return restored

    def _drop_snapshot(self, key: int) -> None:
        dropped = self._prefix_snapshots.pop(key, None)
        if dropped is not None:
            self._prefix_snapshot_bytes -= dropped.data.nbytes

    def _keep_restored(self, entry: _PrefixSnapshot) -> None:
        """Put a restored snapshot back, as the most recently used, if it fits beside the others: it never
        evicts one, since the context already holds its prefix (room for one and two states alternating:
        the cache holds the one the context does not, so each switch restores)."""
        key = _prefix_key(entry.segments)
        if key not in self._prefix_snapshots and self._prefix_snapshot_bytes + entry.data.nbytes <= self.prefix_cache_bytes:
            self._prefix_snapshots[key] = entry
            self._prefix_snapshots.move_to_end(key)
            self._prefix_snapshot_bytes += entry.data.nbytes

    def _snapshot_failed(self, what: str) -> None:
        """A snapshot copy raised: empty the context (llama.cpp may have written part of a sequence) and go on
        cold. The request is answered; the warning says what happened."""
        self.prefix_snapshot_failures += 1
        log.warning("prefix snapshot %s failed; the prefix is evaluated instead", what, exc_info=True)
        self.invalidate()

    def _save_prefix(self, keep: int) -> None:
        """Snapshot the deepest hot boundary of the context beyond ``keep`` segments, not already saved.
        Only boundaries within what the serial path evaluated: a prefix decoded in a batch is never saved."""
        context = self._segments
        keep_tokens = sum(len(s) for s in context[:keep])
        lengths = np.cumsum([len(s) for s in context]).tolist()
        for m in range(min(len(context), self._serial_segments), keep, -1):
            if lengths[m - 1] - keep_tokens < PREFIX_SNAPSHOT_MIN_TOKENS:
                break
            key = _prefix_key(context[:m])
            if self._prefix_seen.get(key, 0) < 2:
                continue
            if key in self._prefix_snapshots:
                self._prefix_snapshots.move_to_end(key)
                return
            if not self._lc.llama_memory_seq_rm(self._memory, SEQ, lengths[m - 1], -1):
                return
            self._segments = context[:m]
            self._serial_segments = min(self._serial_segments, m)
            size = self._lc.llama_state_seq_get_size(self._ctx, SEQ)
            if size <= 0 or size > self.prefix_cache_bytes:
                return
            data = np.empty(size, dtype=np.uint8)
            written = self._lc.llama_state_seq_get_data(self._ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, SEQ)
            if written != size:
                return
            self._prefix_snapshots[key] = _PrefixSnapshot(tuple(context[:m]), lengths[m - 1], data)
            self._prefix_snapshot_bytes += size
            self.prefix_snapshots_taken += 1
            while self._prefix_snapshot_bytes > self.prefix_cache_bytes:
                _, dropped = self._prefix_snapshots.popitem(last=False)
                self._prefix_snapshot_bytes -= dropped.data.nbytes
            return

    def _restore_prefix(self, entry: _PrefixSnapshot) -> int:
        """Bring the context to exactly ``entry``'s prefix; return its segment count, or 0 (context empty)
        when llama.cpp refuses or raises: the caller then evaluates the prefix instead."""
        lc = self._lc
        try:
            lc.llama_memory_seq_rm(self._memory, SEQ, -1, -1)  # removing a whole sequence never fails
            self._segments = []
            self._serial_segments = 0
            data = entry.data
            ok = lc.llama_state_seq_set_data(self._ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), data.nbytes, SEQ)
        except Exception:
            self._snapshot_failed("restore")
            return 0
        if ok == 0:  # cannot happen with a snapshot of this context; the snapshot is not kept
            self.prefix_snapshot_failures += 1
            log.warning("prefix snapshot restore refused by llama.cpp; the prefix is evaluated instead")
            self.invalidate()
            return 0
        self._segments = list(entry.segments)
        self._serial_segments = len(self._segments)  # snapshots are only taken of serial segments
        self.prefix_restores += 1
        self.prefix_restored_tokens += entry.n_tokens
        return len(entry.segments)

    # ---- scoring ------------------------------------------------------------------------------

    def score(
        self,
        state_text: str,
        questions: Sequence[Question],
        *,
        scoring: Optional[str] = None,
        return_prompt: bool = False,
        cancel: Optional[Callable[[], bool]] = None,
        layout: str = "state_first",
        injection_check: bool = False,
        debias: Optional[str] = None,
        second_look: Optional[SecondLook] = None,
    ) -> ScoreResult:
        """Plan and execute in one call (tools and tests; the HTTP layer plans before admission)."""
        planned = self.plan(state_text, questions, scoring=scoring, return_prompt=return_prompt, layout=layout,
                            injection_check=injection_check, debias=debias, second_look=second_look)
        return self.execute(planned, cancel=cancel)

    def execute(self, plan: PromptPlan, *, cancel: Optional[Callable[[], bool]] = None) -> ScoreResult:
        """Run a finished plan on the context. ``cancel`` is asked before each question and between the
        ``n_batch``-token batches of a longer segment (a long state); when it returns True the engine raises
        Cancelled and the context stays consistent (a segment stopped part-way is dropped). Any other exception empties
        the context and its bookkeeping, so the next request starts from a known state."""
        started = time.perf_counter()
        with self.lock, self._running(plan, cancel):
            # The request's prefix is counted before its content-free pass: a state the context holds from
            # an earlier request is then a prefix seen twice, which the pass snapshots before it rewinds past
            # it (_use_prefix_snapshots) and the request's own pass restores, instead of evaluating the state
            # again (a new question, or the other option order, on a held state).
            self._note_prefix(plan.prefix_segments)
            priors = self._content_free_priors(plan, cancel, started) if plan.content_free is not None else None
            return self._execute(plan, cancel, started, priors)

    @contextlib.contextmanager
    def _running(self, plan: PromptPlan, cancel: Optional[Callable[[], bool]]):
        """The cancel hook installed for one plan's work; Cancelled passes through, any other failure
        empties the context and its bookkeeping."""
        self._cancel, self._cancel_progress, self._unchecked_tokens = cancel, (0, len(plan.questions)), 0
        try:
            yield
        except Cancelled:
            raise
        except BaseException:
            self.invalidate()
            raise
        finally:
            self._cancel = None
            self._record_prefix = None  # the records keep what they share; the engine does not keep it

    def _content_free_key(self, content_free: PromptPlan, qplan: QuestionPlan) -> bytes:
        variants = [t for variant in (qplan.label_variants or ()) for t in (*variant, -1)]
        # Fused or not, the same tokens decode in other batch shapes (other kernels): part of the key.
        variants.append(-2 if content_free.fuse_state_and_question else -3)
        return _tokens_key(content_free.prefix_segments, qplan.suffix_tokens, variants)

    def _content_free_priors(self, plan: PromptPlan, cancel: Optional[Callable[[], bool]],
                             started: float) -> "_Priors":
        """Each question's content-free prior (log-probabilities over its labels, in shown order): the ones
        held, else the content-free plan evaluated now (all its questions, so that they share its prefix) and
        kept. Stored only once the whole pass has succeeded: a pass cancelled or failed part-way keeps nothing."""
        content_free = plan.content_free
        keys = [self._content_free_key(content_free, q) for q in content_free.questions]
        planned = plan.content_free_held or (None,) * len(keys)
        priors = [self._content_free.get(key) for key in keys]
        for i, (key, prior) in enumerate(zip(keys, priors)):
            if prior is None and planned[i] is not None:  # held when planned, evicted since: kept again
                prior = priors[i] = self._content_free[key] = list(planned[i])
            if prior is not None:
                self._content_free.move_to_end(key)
        missing = [i for i, prior in enumerate(priors) if prior is None]
        if not missing:
            return _Priors(priors, [True] * len(keys), 0, [0] * len(keys), _abstain_indices(plan))
        # Only the questions whose prior is not held, each distinct one once, from the content-free prefix
        # (evaluated once for them): what the plan's budget counted.
        first_of: dict[bytes, int] = {}
        distinct = [i for i in missing if first_of.setdefault(keys[i], i) == i]
        subset = replace(content_free, questions=tuple(content_free.questions[i] for i in distinct))
        self._note_prefix(subset.prefix_segments)
        try:
            result = self._execute(subset, cancel, started)
        except Cancelled:
            raise Cancelled(0, len(plan.questions)) from None  # none of the request's own questions was answered
        self.content_free_passes += 1
        evaluated = [0] * len(keys)
        for i, dist in zip(distinct, result.distributions):
            priors[i], evaluated[i] = _log_softmax(dist.option_logits), dist.evaluated_tokens
            self._content_free[keys[i]] = priors[i]
            self._content_free.move_to_end(keys[i])
        for i in missing:
            priors[i] = priors[first_of[keys[i]]]
        while len(self._content_free) > self.content_free_entries:
            self._content_free.popitem(last=False)
        shared = 0
        for mine, theirs in zip(plan.prefix_segments, content_free.prefix_segments):
            if mine != theirs:
                break
            shared += len(mine)
        fresh = max(0, shared - result.state_cached_tokens)
        return _Priors(priors, [i not in missing for i in range(len(keys))], result.evaluated_tokens, evaluated,
                       _abstain_indices(plan), fresh)

    def content_free_priors(self, plan: PromptPlan, cancel: Optional[Callable[[], bool]] = None) -> "_Priors":
        """The plan's content-free priors (held, or evaluated now on the serial path) for a caller that holds
        ``lock`` and scores the plan itself (batching.py). Cancelled passes through; any other failure
        empties the context, as ``execute`` does."""
        with self._running(plan, cancel):
            return self._content_free_priors(plan, cancel, time.perf_counter())

    @staticmethod
    def apply_content_free(result: ScoreResult, priors: "_Priors") -> ScoreResult:
        """A result scored without its priors (batching.py), with them divided out, as ``execute`` does."""
        result.distributions = _with_priors(result.distributions, priors)
        result.evaluated_tokens += priors.evaluated_tokens
        moved = min(priors.fresh_shared, result.state_cached_tokens)  # decoded by this request's own pass
        result.state_cached_tokens -= moved
        result.cached_tokens -= moved
        return result

    def clear_content_free(self) -> None:
        """Forget every content-free prior (the next content_free request evaluates its own again)."""
        self._content_free.clear()

    def _execute(self, plan: PromptPlan, cancel: Optional[Callable[[], bool]], started: float,
                 priors: Optional["_Priors"] = None) -> ScoreResult:
        """Score a plan whose prefix its caller has counted (_note_prefix), its priors already evaluated."""
        if not self.prefix_cache:
            self.invalidate()
        # Where this request's own pass starts decoding; what its content-free pass decoded of the prefix
        # they share (the template head) is taken off the reuse below (priors.fresh_shared).
        self._decoded_from = None
        prefix = [list(s) for s in plan.prefix_segments]
        prefix_len = plan.state_tokens
        distributions = []
        evaluated = memo_suffix_tokens = 0
        for index, qplan in enumerate(plan.questions):
            if cancel is not None and cancel():
                raise Cancelled(index, len(plan.questions))
            self._cancel_progress, self._unchecked_tokens = (index, len(plan.questions)), 0
            q_started = time.perf_counter()
            dist, memo_tokens = self._score_question(plan, qplan, prefix)
            if qplan.reversed is not None and qplan.reversed.own_prefix_segments is None:
                dist, memo_tokens = self._debias(plan, qplan, prefix, dist, memo_tokens)
            dist.compute_ms = (time.perf_counter() - q_started) * 1000
            evaluated += dist.evaluated_tokens
            memo_suffix_tokens += memo_tokens
            distributions.append(dist)
        suspected: dict[int, float] = {}  # by check (copies of a question share one)
        for check in plan.injection_checks:
            if id(check) in suspected:
                continue
            if cancel is not None and cancel():
                raise Cancelled(len(plan.questions), len(plan.questions))
            self._cancel_progress, self._unchecked_tokens = (len(plan.questions), len(plan.questions)), 0
            suspected[id(check)], check_evaluated, check_memo = self._injection_check(check, prefix)
            evaluated += check_evaluated
            memo_suffix_tokens += check_memo
        # Options-first with debias: the reversed order has its own prefix (reversed options, then the
        # state), so it runs last, after everything that reuses the given order's prefix.
        for index, qplan in enumerate(plan.questions):
            if qplan.reversed is not None and qplan.reversed.own_prefix_segments is not None:
                self._cancel_progress = (index, len(plan.questions))
                q_started = time.perf_counter()
                given = distributions[index]
                evaluated -= given.evaluated_tokens
                dist, memo_tokens = self._debias(plan, qplan, prefix, given, 0)
                dist.compute_ms = given.compute_ms + (time.perf_counter() - q_started) * 1000
                evaluated += dist.evaluated_tokens
                memo_suffix_tokens += memo_tokens
                distributions[index] = dist
        if priors is not None:
            distributions = _with_priors(distributions, priors)
            evaluated += priors.evaluated_tokens
        if plan.second_look is not None:
            for index in range(len(plan.questions)):
                distributions[index] = self._second_look(plan, index, prefix, distributions[index], cancel)
                evaluated += distributions[index].second_look.get("evaluated_tokens", 0)
        for dist, check in zip(distributions, plan.injection_checks):
            dist.injection_suspected = suspected[id(check)]
        # One value per request where a contract reports one: the most suspicious of its questions' checks.
        injection_suspected = max(suspected.values()) if suspected else None
        # Honest reuse: the state prefix counts as cached only up to the first position this request
        # had to evaluate (a later question may re-evaluate what an earlier memo hit skipped).
        decoded_from = self._decoded_from
        state_cached = prefix_len if decoded_from is None else min(prefix_len, decoded_from)
        if priors is not None:
            state_cached -= min(priors.fresh_shared, state_cached)
        return ScoreResult(
            distributions=distributions,
            state_tokens=prefix_len,
            input_tokens=plan.input_tokens,
            cached_tokens=state_cached + memo_suffix_tokens,
            evaluated_tokens=evaluated,
            compute_ms=(time.perf_counter() - started) * 1000,
            state_cached_tokens=state_cached,
            template_version=plan.template_version,
            layout=plan.layout,
            injection_suspected=injection_suspected,
            prefix_text=plan.prefix_text if plan.return_prompt else None,
        )

    def _injection_check(self, check: QuestionPlan, prefix: list[list[int]]) -> tuple[float, int, int]:
        """p(yes) of one injection check. Options-first: scored from the same prefix as its question (the
        state is already in the context). State-first: from the check's own prefix, its question and options,
        then the state (INJECTION_CHECK_LAYOUT), so the state is evaluated again.
        Returns (probability, evaluated tokens, suffix tokens answered by the memo)."""
        if check.own_prefix_segments is not None:
            prefix = [list(s) for s in check.own_prefix_segments]
        dist = self._score_labels(check, prefix, check.suffix_tokens)
        return dist.probabilities[0], dist.evaluated_tokens, len(check.suffix_tokens) if dist.evaluated_tokens == 0 else 0

    def _score_question(self, plan: PromptPlan, qplan: QuestionPlan, prefix: list[list[int]]) -> tuple[Distribution, int]:
        """One question in the order its plan shows the outcomes; (distribution with outcomes in that
        shown order, suffix tokens answered from the memo). A question with its own prefix (options-first,
        reversed order) is scored after that prefix instead of the plan's."""
        prefix_text = plan.prefix_text
        if qplan.own_prefix_segments is not None:
            prefix = [list(s) for s in qplan.own_prefix_segments]
            prefix_text = "".join(piece.text for piece in qplan.own_prefix_pieces or ())
        suffix = qplan.suffix_tokens
        if plan.scoring == "label":
            # Recurrent models restart each question from a snapshot of the whole prefix: nothing to fuse.
            dist = self._score_labels(qplan, prefix, suffix, fuse=plan.fuse_state_and_question and self.partial_rewind,
                                      record=plan.return_prompt)
        else:
            dist = self._score_sequence(prefix, suffix, [list(a) for a in qplan.answer_tokens], record=plan.return_prompt)
        if plan.return_prompt:
            dist.prompt_text = prefix_text + qplan.text
        return dist, (len(suffix) if dist.evaluated_tokens == 0 else 0)

    def _debias(self, plan: PromptPlan, qplan: QuestionPlan, prefix: list[list[int]], given: Distribution,
                memo_tokens: int) -> tuple[Distribution, int]:
        """Order debiasing: score the reversed order from the same state prefix (one more question
        segment; the state is not evaluated again) and combine the two orders (combine_orders)."""
        back, back_memo = self._score_question(plan, qplan.reversed, prefix)
        order = qplan.reversed.order
        n = len(order)

        def unshuffle(values):  # shown order -> given order
            out = [0.0] * n
            for shown, original in enumerate(order):
                out[original] = values[shown]
            return out

        back_logits = unshuffle(back.option_logits)
        combined = combine_orders(given.option_logits, back_logits)
        masses = [m for m in (given.label_mass, back.label_mass) if m is not None]
        orders = {
            "given": {"probabilities": given.probabilities, "option_logits": given.option_logits,
                      "label_mass": given.label_mass},
            "reversed": {"probabilities": unshuffle(back.probabilities), "option_logits": back_logits,
                         "label_mass": back.label_mass, "labels": back.labels, "label_token_ids": back.label_token_ids},
        }
        recompute = None
        if plan.return_prompt:
            orders["reversed"]["prompt_text"] = back.prompt_text
            # option_logits = combine_orders(given, reversed put back in the given order by ``order``).
            recompute = dict(given.recompute or {})
            recompute["reversed"] = dict(back.recompute or {}, order=list(order))
        dist = Distribution(
            recompute=recompute,
            option_logits=combined,
            probabilities=softmax(combined),
            tokens=given.tokens + qplan.reversed.input_tokens,
            cached_tokens=given.cached_tokens + back.cached_tokens,
            evaluated_tokens=given.evaluated_tokens + back.evaluated_tokens,
            scoring=given.scoring,
            label_token_ids=given.label_token_ids,
            labels=given.labels,
            prompt_text=given.prompt_text,
            label_mass=sum(masses) / len(masses) if masses else None,
            label_variant_ids=given.label_variant_ids,
            debias="reverse",
            orders=orders,
        )
        return dist, memo_tokens + back_memo

    def _second_look_suffix(self, plan: PromptPlan, qplan: QuestionPlan) -> list[int]:
        """The second look's suffix tokens after the plan's prefix (PromptTemplate.second_look_suffix_parts)."""
        template = self.template
        block, tail = template.second_look_suffix_parts(qplan.question, list(qplan.labels), list(qplan.order), plan.layout)
        if template.between and not qplan.pieces[0].text.startswith(template.between) and block.startswith(template.between):
            block = block[len(template.between):]  # the prefix took the blank line after the state (plan._join_across)
        block_tokens, tail_tokens = _question_tokens(self._tokenize, plan.prefix_text, block, tail)
        return list(block_tokens) + list(tail_tokens)

    def _second_look(self, plan: PromptPlan, index: int, prefix: list[list[int]], first: Distribution,
                     cancel: Optional[Callable[[], bool]]) -> Distribution:
        """The second look (plan.SecondLook) at one answer: nothing when the first pass is clear; else greedy
        reasoning from the same prefix within the token budget and deadline, then the labels read after
        SECOND_LOOK_CUE. When no reasoning token fits (deadline, context) the first pass decides. The client
        going away or the request deadline raises Cancelled, as everywhere in the engine. The context keeps
        the prefix; the label memo is not used."""
        qplan = plan.questions[index]
        config = plan.second_look
        reason = config.reason(first.probabilities, first.label_mass)
        if reason is None:
            first.second_look = {"ran": False, "decided_by": "first_pass"}
            return first
        started = time.perf_counter()
        deadline = started + config.deadline_s
        suffix = list(plan.second_look_suffixes[index])
        cue = self._tokenize(SECOND_LOOK_CUE, special=False)
        base = sum(len(s) for s in prefix) + len(suffix)
        budget = min(config.max_tokens, self.n_ctx - base - len(cue))
        first_pass = {"probabilities": first.probabilities, "option_logits": first.option_logits,
                      "label_mass": first.label_mass}
        if first.recompute is not None:
            first_pass["recompute"] = first.recompute  # semif-recompute reproduces the first pass, not the second

        def kept(stopped: str, evaluated: int = 0) -> Distribution:
            """No reasoning happened: the first pass decides."""
            first.second_look = {"ran": False, "decided_by": "first_pass", "reason": reason, "stopped": stopped,
                                 "version": SECOND_LOOK_VERSION, "reasoning_tokens": 0, "evaluated_tokens": evaluated,
                                 "ms": round((time.perf_counter() - started) * 1000, 3)}
            first.evaluated_tokens += evaluated
            return first

        if budget < 1:
            return kept("context")
        if time.perf_counter() >= deadline:
            return kept("deadline")
        variants = [list(v) for v in first.label_variant_ids or [(t,) for t in first.label_token_ids]]
        stop_tokens = {self.end_of_turn_token, self.llm.token_eos()}
        vocab = self._lc.llama_model_get_vocab(self._model)
        past_deadline = False

        def stop() -> bool:
            """Asked between the batches of the prefix (evaluated again when a check or the other option order
            took the context) and the suffix: the request's hook, then this look's own deadline."""
            nonlocal past_deadline
            if cancel is not None and cancel():
                return True
            past_deadline = time.perf_counter() >= deadline
            return past_deadline

        outer_cancel, self._cancel = self._cancel, stop
        decoded_before = self._decoded_tokens
        try:
            try:
                self._ensure_prefix(prefix)
                rows, reused, evaluated = self._forward(prefix + [suffix], [base - 1])
            except Cancelled:
                if not past_deadline:
                    raise Cancelled(index, len(plan.questions)) from None
                return kept("deadline", self._decoded_tokens - decoded_before)
            self._cancel = None  # the loop below asks the hook itself, per token
            row, position = rows[base - 1], base - 1
            generated: list[int] = []
            pieces = bytearray()  # bytes, decoded once: a character may span tokens
            stopped = "budget"
            while True:
                if cancel is not None and cancel():
                    raise Cancelled(index, len(plan.questions))
                if len(generated) >= budget:
                    stopped = "budget"
                    break
                if time.perf_counter() >= deadline:
                    stopped = "deadline"
                    break
                token = int(np.argmax(row))
                if token in stop_tokens or self._lc.llama_vocab_is_eog(vocab, token):
                    stopped = "end_of_turn"
                    break
                generated.append(token)
                position += 1
                row = self._decode([token], {position})[position]
                evaluated += 1
                pieces += self.llm.detokenize([token], special=True)
                # "Answer:" on a line of its own or after a sentence, not an echo of the instruction's quote.
                tail = bytes(pieces[-16:]).rstrip()
                if tail.endswith(b"Answer:") and not tail.endswith(b'"Answer:'):
                    stopped = "answer"
                    break
            if not generated:
                return kept(stopped, evaluated)
            if stopped != "answer":
                position += len(cue)
                row = self._decode(cue, {position})[position]
                evaluated += len(cue)
            logits, label_mass = _label_logits(row, variants)
        finally:
            self._cancel = outer_cancel
            self._rewind(len(prefix))
        probabilities = softmax(logits)
        return Distribution(
            option_logits=logits, probabilities=probabilities, tokens=first.tokens, cached_tokens=first.cached_tokens,
            evaluated_tokens=first.evaluated_tokens + evaluated, scoring="label", label_token_ids=first.label_token_ids,
            labels=first.labels, prompt_text=first.prompt_text, label_mass=label_mass, label_variant_ids=variants,
            debias=first.debias, orders=first.orders, content_free=first.content_free, compute_ms=first.compute_ms,
            second_look={
                "ran": True, "decided_by": "second_look", "reason": reason, "version": SECOND_LOOK_VERSION,
                "first_pass": first_pass, "reasoning": pieces.decode("utf-8", errors="replace"),
                "reasoning_tokens": len(generated), "stopped": stopped,
                "evaluated_tokens": evaluated, "ms": round((time.perf_counter() - started) * 1000, 3),
            },
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
        while keep < min(len(wanted), self._serial_segments) and self._segments[keep] == wanted[keep]:
            keep += 1
        self._rewind(keep)
        for segment in prefix[len(self._segments) :]:
            self._decode(segment, set())
        self._take_snapshot()

    def _memo_key(self, prefix: list[list[int]], suffix: Sequence[int], label_ids: Sequence[int]) -> bytes:
        """``_tokens_key``, with the prefix hashed once per request rather than once per question: the
        digest of the last prefix list seen is kept, by identity (``_execute`` builds one list per
        request and no one mutates it; holding the reference keeps its id from being reused)."""
        cached = self._memo_prefix
        if cached is None or cached[0] is not prefix:
            cached = self._memo_prefix = (prefix, _tokens_digest(prefix))
        return _tokens_digest((suffix, label_ids), cached[1].copy()).digest()

    def _record_segments(self, prefix: list[list[int]], suffix: Sequence[int]) -> list[dict]:
        """``recompute_segments(prefix + [suffix])``, the prefix's entries built once per prefix list and shared by
        every question's record (kept by identity, as ``_memo_key`` keeps its digest, and let go when the request
        ends, ``_running``): a request's records hold its state once, not once per question. Nobody mutates them: the
        contracts copy what they rewrite (contracts/semif.py, shared_prompt)."""
        held = self._record_prefix
        if held is None or held[0] is not prefix:
            held = self._record_prefix = (prefix, recompute_segments(prefix))
        return held[1] + recompute_segments([suffix], start=sum(len(s) for s in prefix))

    def _score_labels(self, qplan: QuestionPlan, prefix: list[list[int]], suffix: list[int], *, fuse: bool = False,
                      record: bool = False) -> Distribution:
        """``fuse``: evaluate the prefix's last segment and the suffix as one segment
        (PromptPlan.fuse_state_and_question); the memo keeps fused and split logits apart. ``record``:
        attach the recompute record (the segments as decoded; a memo hit was decoded the same way)."""
        label_ids = list(qplan.label_token_ids or ())
        variants = [list(v) for v in (qplan.label_variants or [(t,) for t in label_ids])]
        total = sum(len(s) for s in prefix) + len(suffix)
        use_memo = self.label_memo and self.prefix_cache
        key = self._memo_key(prefix, suffix, [t for v in variants for t in v] + [-1] + [len(v) for v in variants]
                             + ([-2] if fuse else [])) if use_memo else b""
        remembered = self._label_memo.get(key) if use_memo else None
        if remembered is not None:
            self._label_memo.move_to_end(key)
            logits, label_mass = remembered
            reused, evaluated = total, 0
        else:
            self._ensure_prefix(prefix)
            rows, reused, evaluated = self._forward(self._label_segments(prefix, suffix, fuse), [total - 1])
            logits, label_mass = _label_logits(rows[total - 1], variants)
            if use_memo:
                self._label_memo[key] = (logits, label_mass)
                while len(self._label_memo) > LABEL_MEMO_SIZE:
                    self._label_memo.popitem(last=False)
        temperature = qplan.temperature
        recompute = None
        if record:
            recompute = {"scoring": "label", "settings": dict(self.numerics),
                         "segments": (recompute_segments(self._label_segments(prefix, suffix, fuse)) if fuse
                                      else self._record_segments(prefix, suffix)),
                         "logits_at": [total - 1], "label_variant_ids": variants}
        return Distribution(
            recompute=recompute,
            option_logits=logits,
            probabilities=softmax([x / temperature for x in logits]) if temperature else softmax(logits),
            temperature=temperature,
            tokens=total,
            cached_tokens=reused,
            evaluated_tokens=evaluated,
            scoring="label",
            label_token_ids=label_ids,
            labels=list(qplan.labels or ()),
            label_mass=label_mass,
            label_variant_ids=variants,
        )

    @staticmethod
    def _label_segments(prefix: list[list[int]], suffix: Sequence[int], fuse: bool) -> list[list[int]]:
        return prefix[:-1] + [prefix[-1] + list(suffix)] if fuse and prefix else prefix + [list(suffix)]

    def _score_sequence(self, prefix: list[list[int]], suffix: list[int], answers: list[list[int]], *,
                        record: bool = False) -> Distribution:
        """Cloze scoring: mean log-probability of each answer's tokens (which end with the end-of-turn
        token) after the prompt.

        The whole prompt is evaluated once, its question suffix as one segment with logits at its last
        position: that one row gives the first answer token's distribution for every option, so the
        options compared share the same first-token numbers (re-running the prompt's last token once per
        option, in batches of different sizes, put kernel drift between them). Each answer's remaining
        tokens are then one segment after the prompt, with logits at every position."""
        self._ensure_prefix(prefix)
        prompt_len = sum(len(s) for s in prefix) + len(suffix)
        body = prefix + [suffix]
        rows, reused, evaluated = self._forward(body, [prompt_len - 1])
        first_row = rows[prompt_len - 1][None, :]
        scores, per_token = [], []
        for answer in answers:
            logprobs = [float(_token_logprobs(first_row, answer[:1])[0])]
            tail = answer[:-1]
            if tail:
                positions = list(range(prompt_len, prompt_len + len(tail)))
                rows, _, n_eval = self._forward(body + [tail], positions)
                evaluated += n_eval
                logprobs += _token_logprobs(np.stack([rows[p] for p in positions]), answer[1:]).tolist()
            per_token.append(logprobs)
            scores.append(float(sum(logprobs) / len(logprobs)))
        scores = [s if math.isfinite(s) else -1e30 for s in scores]
        recompute = None
        if record:
            # Each answer: its tokens; all but the last are one more segment after the prompt (the context
            # rewound to the prompt's end first), logits at every position of it.
            recompute = {"scoring": "sequence", "settings": dict(self.numerics), "segments": self._record_segments(prefix, suffix),
                         "logits_at": [prompt_len - 1], "answers": [[int(t) for t in a] for a in answers]}
        return Distribution(
            recompute=recompute,
            option_logits=scores,
            probabilities=softmax(scores),
            tokens=prompt_len,
            cached_tokens=reused,
            evaluated_tokens=evaluated,
            scoring="sequence",
            answer_token_logprobs=per_token,
        )

    def close(self) -> None:
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        self.llm.close()
