"""The scoring core: one llama.cpp context, a token-prefix cache, and logits read after one forward pass.

Knows llama.cpp, tokens and prompts; knows nothing of HTTP or JSON shapes. Not thread-safe: one
computation at a time (the HTTP layer's admission control guarantees that). The decision-level passes
(option orders, injection checks, content-free priors, the second look) are modules of their own in
``passes/``, which says what they may call here; ``Engine._execute`` runs them in turn.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from .machine import cpu_name, default_n_ctx, ggml_type_name, gpu_name
from .manifest import sha256_file
from .native import NativeDecision, ScoringUnsupported, build_native_plan, read_native_decision
from .passes import Answers, injection, orders, prior, rotations
from .passes import second_look as second_look_pass
from .plan import (DEBIAS_MODES, EngineError, LabelError, PlanError, PromptPlan, PromptTooLong, QuestionPlan, SecondLook,
                   TokenBudgetExceeded, build_plan, served_debias, shared_lead)
from .prompt import Labels, PromptTemplate, Question, TEMPLATE_VERSION, normalise_for_fence
from .readout import label_logits, token_logprobs, tokens_digest
from .results import Cancelled, Distribution, ScoreResult, softmax
from .token_cache import TokenCache

__all__ = ["Cancelled", "Distribution", "Engine", "EngineError", "LabelError", "PlanError", "PromptPlan",
           "PromptTooLong", "ScoreResult", "TokenBudgetExceeded", "softmax"]

log = logging.getLogger("semif.engine")

SEQ = 0  # the one sequence this context holds
LABEL_MEMO_SIZE = 256  # identical prompts remembered (label logits only: a few floats each)
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


def recompute_segments(segments: Sequence[Sequence[int]], start: int = 0) -> list[dict]:
    """Segments as the recompute record lists them: each one's first position and tokens (the first at ``start``)."""
    out, pos = [], start
    for segment in segments:
        out.append({"pos": pos, "tokens": [int(t) for t in segment]})
        pos += len(segment)
    return out


class _Lead(tuple):
    """A held segment: the first ``n`` tokens of a first read's suffix, evaluated with the rest of that suffix
    (``of``: (that suffix, n)). Equal to its tokens as a tuple, but never reused as if evaluated alone."""

    of: tuple

    def __new__(cls, tokens: Sequence[int], *, of: tuple):
        self = super().__new__(cls, tokens)
        self.of = of
        return self


@dataclass
class _PrefixSnapshot:
    """The KV of one sequence holding exactly ``segments`` (llama_state_seq_get_data's bytes)."""

    segments: tuple[tuple[int, ...], ...]
    n_tokens: int
    data: np.ndarray  # uint8


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
        content_free_entries: int = prior.CONTENT_FREE_ENTRIES,
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
        # hundreds of cue + label strings) and by characters: only short strings are kept (see TokenCache).
        self._template_tokens = TokenCache(
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
        # debias "content_free": each question's prior, kept across requests (passes/prior.py).
        self.prior_memo = prior.PriorMemo(content_free_entries)
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
            "hardware": (gpu_name() if llama_cpp.llama_supports_gpu_offload() else None) or cpu_name(),
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
            "type_k": ggml_type_name(self.llm.context_params.type_k),
            "type_v": ggml_type_name(self.llm.context_params.type_v),
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
            # way (to see whether special tokens change it): long strings are not kept (TokenCache).
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
        reads: Optional[int] = None,
    ) -> PromptPlan:
        """Everything per request that does not need the context: fencing, tokens, labels, length and
        budget checks. Safe to call from any thread while the model thread computes: llama.cpp's
        tokenizer only reads the vocabulary. ``layout`` and ``injection_check``: see plan.build_plan.
        ``second_look``: see plan.SecondLook (label scoring only; its worst case counts in the budget).

        A request over the token budget (``max_request_tokens``) is refused naming what pushed it over: the
        questions (``budget_field``), then, in this order, each addition that does not fit on top of them: the
        injection checks (``injection_check_field``), the debiasing's reads and content-free prompts (``debias``,
        or ``budget_field`` under the server default), the second look (``second_look_field``)."""
        if second_look is not None:
            # Everything but the second look is planned, and refused, as without it.
            planned = self.plan(state_text, questions, scoring=scoring, return_prompt=return_prompt,
                                state_field=state_field, question_fields=question_fields,
                                question_names=question_names, budget_field=budget_field,
                                max_request_tokens=max_request_tokens, layout=layout, injection_check=injection_check,
                                layout_field=layout_field, debias=debias, default_debias=default_debias,
                                injection_check_field=injection_check_field, reads=reads)
            return second_look_pass.plan_look(self, planned, second_look, native=self.native is not None,
                                              max_request_tokens=max_request_tokens, field=second_look_field)
        scoring = scoring or self.default_scoring
        if scoring not in ("label", "sequence"):
            raise EngineError(f"unknown scoring method {scoring!r}", field="scoring")
        by_default = debias is None
        if by_default:
            # The server's default (``default_debias``, else SEMIF_DEBIAS as serve set it) where it applies
            # (served_debias); a request that asks for a mode a scoring or model cannot take is refused, naming
            # the field.
            debias = served_debias(default_debias or getattr(self, "default_debias", "none"), scoring=scoring,
                                   layout=layout, native=self.native is not None)
        if debias not in DEBIAS_MODES:
            raise PlanError(f"unknown debias mode {debias!r}; use one of {', '.join(DEBIAS_MODES)}", field="debias")
        if reads is not None and debias not in ("rotations", "reverse"):
            why = (" (the server's default debiasing, which reads once under this scoring, layout or model)"
                   if by_default else "")
            raise PlanError(f"reads applies to debias 'reverse' and 'rotations' (this request's debias is {debias!r}"
                            f"{why}): send one of them with it, or leave reads out", field="reads")
        if debias == "rotations" and scoring != "label":
            raise PlanError("debias 'rotations' reads label probabilities: it needs scoring 'label'", field="debias")
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
            **({"reads": reads} if reads is not None else {}),  # debias "rotations": see plan.build_plan
        )
        build = functools.partial(build_plan, **common, state_text=state_text, state_field=state_field,
                                  max_request_tokens=max_request_tokens, return_prompt=return_prompt,
                                  injection_check=injection_check, debias=debias)
        if debias in ("reverse", "rotations"):
            return orders.plan_orders(build, max_request_tokens=max_request_tokens, budget_field=budget_field,
                                      by_default=by_default, debias=debias)
        if debias == "content_free":
            return prior.plan_priors(self, build, scoring=scoring, max_request_tokens=max_request_tokens,
                                     budget_field=budget_field, by_default=by_default)
        return build()

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

    def _forward(self, segments: list[Sequence[int]], positions: list[int], *,
                 hold: bool = False) -> tuple[dict[int, np.ndarray], int, int]:
        """Logits at absolute ``positions`` (all inside the last segment), reusing the longest run of
        leading segments the context already holds. Returns (rows, reused tokens, evaluated tokens).
        ``hold``: no logits wanted, only the context holding ``segments``; the last one is kept too when held."""
        total = sum(len(s) for s in segments)
        if total > self.n_ctx:
            raise PromptTooLong(total, self.n_ctx)
        keep = 0
        # The segment whose logits we need is always evaluated (its rows are not kept).
        limit = len(segments) if hold else len(segments) - 1
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
                    out[tag] = label_logits(row, wanted[tag])
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
        reads: Optional[int] = None,
    ) -> ScoreResult:
        """Plan and execute in one call (tools and tests; the HTTP layer plans before admission)."""
        planned = self.plan(state_text, questions, scoring=scoring, return_prompt=return_prompt, layout=layout,
                            injection_check=injection_check, debias=debias, second_look=second_look, reads=reads)
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
            priors = prior.evaluate(self, plan, cancel, started)
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

    # ---- what the passes see of the core (passes/__init__.py) ------------------------------------

    @property
    def content_free_entries(self) -> int:
        """Content-free priors kept across requests (SEMIF_CONTENT_FREE_ENTRIES)."""
        return self.prior_memo.entries

    @content_free_entries.setter
    def content_free_entries(self, entries: int) -> None:
        self.prior_memo.entries = max(1, int(entries))

    @property
    def content_free_passes(self) -> int:
        """Content-free plans evaluated (the others were answered from held priors)."""
        return self.prior_memo.passes

    def clear_content_free(self) -> None:
        """Forget every content-free prior (the next content_free request evaluates its own again)."""
        self.prior_memo.clear()

    def _progress(self, done: int, total: int, *, restart_batch_count: bool = True) -> None:
        """What a Cancelled raised inside the context reports: ``done`` of ``total`` questions. By default the
        tokens decoded since the cancel hook was last asked count from 0 again (a new question starts)."""
        self._cancel_progress = (done, total)
        if restart_batch_count:
            self._unchecked_tokens = 0

    def _ends_generation(self, token: int) -> bool:
        """Whether greedy generation stops at ``token``: the template's end of turn, end of sequence, or any
        token the vocabulary marks as ending generation."""
        return token in (self.end_of_turn_token, self.llm.token_eos()) or bool(self._lc.llama_vocab_is_eog(self._vocab, token))

    # ---- one plan: the core's reads, then each pass -----------------------------------------------

    def _execute(self, plan: PromptPlan, cancel: Optional[Callable[[], bool]], started: float,
                 priors: Optional[prior.Priors] = None) -> ScoreResult:
        """Score a plan whose prefix its caller has counted (_note_prefix), its priors already evaluated
        (prior.evaluate): every question read, then the passes in turn (passes/__init__.py)."""
        if not self.prefix_cache:
            self.invalidate()
        # Where this request's own reads start decoding; what its content-free pass decoded of the prefix
        # they share (the template head) is taken off the reuse below (prior.apply).
        self._decoded_from = None
        prefix = [list(s) for s in plan.prefix_segments]
        answers = self._read_questions(plan, prefix, cancel)
        injection.run(self, plan, prefix, answers, cancel)
        orders.read_with_own_prefix(self, plan, prefix, answers)
        rotations.read_with_own_prefix(self, plan, prefix, answers)
        # What the stop rule (or a request's reads) left unread is not part of this request's prompt.
        unread = sum(d.unread_tokens for d in answers.distributions)
        prior.apply(answers, priors)
        second_look_pass.run(self, plan, prefix, answers, cancel)
        injection_suspected = injection.attach(plan, answers.distributions, answers)
        # Honest reuse: the state prefix counts as cached only up to the first position this request
        # had to evaluate (a later question may re-evaluate what an earlier memo hit skipped).
        prefix_len = plan.state_tokens
        decoded_from = self._decoded_from
        state_cached = prefix_len if decoded_from is None else min(prefix_len, decoded_from)
        state_cached -= min(answers.prefix_decoded_by_passes, state_cached)
        return ScoreResult(
            distributions=answers.distributions,
            state_tokens=prefix_len,
            input_tokens=plan.input_tokens - unread,
            cached_tokens=state_cached + answers.memo_suffix_tokens,
            evaluated_tokens=answers.evaluated,
            compute_ms=(time.perf_counter() - started) * 1000,
            state_cached_tokens=state_cached,
            template_version=plan.template_version,
            layout=plan.layout,
            injection_suspected=injection_suspected,
            prefix_text=plan.prefix_text if plan.return_prompt else None,
        )

    def _read_questions(self, plan: PromptPlan, prefix: list[list[int]],
                        cancel: Optional[Callable[[], bool]]) -> Answers:
        """Every question in the order its plan shows, and right after each, its other orders that share the
        prefix the context then holds (orders.read_on_held_prefix)."""
        answers = Answers()
        total = len(plan.questions)
        for index, qplan in enumerate(plan.questions):
            if cancel is not None and cancel():
                raise Cancelled(index, total)
            self._progress(index, total)
            q_started = time.perf_counter()
            dist, memo_tokens = self._score_question(plan, qplan, prefix)
            dist, memo_tokens = orders.read_on_held_prefix(self, plan, qplan, prefix, dist, memo_tokens)
            dist, memo_tokens = rotations.read_on_held_prefix(self, plan, qplan, prefix, dist, memo_tokens)
            dist.compute_ms = (time.perf_counter() - q_started) * 1000
            answers.evaluated += dist.evaluated_tokens
            answers.memo_suffix_tokens += memo_tokens
            answers.distributions.append(dist)
        return answers

    def _score_question(self, plan: PromptPlan, qplan: QuestionPlan, prefix: list[list[int]],
                        after: Optional[QuestionPlan] = None) -> tuple[Distribution, int]:
        """One question in the order its plan shows the outcomes; (distribution with outcomes in that
        shown order, suffix tokens answered from the memo). A question with its own prefix (options-first,
        reversed order) is scored after that prefix instead of the plan's. ``after``: the question's first
        read, when this is a read in another order; the lead the plan gives it (``QuestionPlan.lead``, the lead
        its question's planned orders share with that read) is then taken from that read's evaluation
        (``_hold_lead``)."""
        prefix_text = plan.prefix_text
        if qplan.own_prefix_segments is not None:
            prefix = [list(s) for s in qplan.own_prefix_segments]
            prefix_text = "".join(piece.text for piece in qplan.own_prefix_pieces or ())
        suffix = qplan.suffix_tokens
        if plan.scoring == "label":
            lead = None
            if qplan.lead:  # planned only where the context rewinds partially and both reads follow the state
                first_suffix = None if after is None else after.suffix_tokens
                if not self.partial_rewind or first_suffix is None or shared_lead(first_suffix, suffix) < qplan.lead:
                    raise EngineError("a read planned to keep its first read's lead does not share it")
                lead = (first_suffix, qplan.lead)
            # Recurrent models restart each question from a snapshot of the whole prefix: nothing to fuse.
            dist = self._score_labels(qplan, prefix, suffix, fuse=plan.fuse_state_and_question and self.partial_rewind,
                                      record=plan.return_prompt, lead=lead)
        else:
            dist = self._score_sequence(prefix, suffix, [list(a) for a in qplan.answer_tokens], record=plan.return_prompt)
        if plan.return_prompt:
            dist.prompt_text = prefix_text + qplan.text
        # Suffix tokens this read spared: all of them from the memo (its shared lead counted with the first read).
        # A read that evaluated the first read's block again (the memo had answered it) takes that read's
        # memo credit back: those tokens were evaluated for this request after all.
        memo_tokens = len(suffix) - qplan.lead if dist.evaluated_tokens == 0 else -dist.redone_tokens
        return dist, memo_tokens


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

    def _hold_lead(self, prefix: list[list[int]], first_suffix: Sequence[int], n: int) -> int:
        """Bring the context to ``prefix`` and the first ``n`` tokens of ``first_suffix`` as that suffix's own
        evaluation left them: where it holds them already (a read in another order came before), drop what
        followed; else hold ``prefix + [first_suffix]`` (evaluated serially, as the first read is) and drop
        its tokens from ``n`` on. Those n cells were computed in one batch with the rest of the first read's
        suffix, so they are the same cells whether the first read was just evaluated or answered from the
        memo. The held lead is recorded as a ``_Lead`` segment, which ``_forward`` never reuses (it is not a
        serial segment): only this method reads it, for the same suffix and ``n``. Returns how many tokens of
        ``first_suffix`` it evaluated (all of them, or none)."""
        k = len(prefix)
        held = self._segments
        evaluated = 0
        if not (len(held) > k and isinstance(held[k], _Lead) and held[k].of == (tuple(first_suffix), n)
                and self._serial_segments >= k and held[:k] == [tuple(s) for s in prefix]):
            start = sum(len(s) for s in prefix)
            _, reused, _ = self._forward(prefix + [list(first_suffix)], [], hold=True)
            evaluated = 0 if reused == start + len(first_suffix) else len(first_suffix)
            if not self._lc.llama_memory_seq_rm(self._memory, SEQ, start + n, -1):
                self.invalidate()
                raise EngineError("the context could not drop the end of a sequence")
            self._segments = self._segments[:k] + [_Lead(first_suffix[:n], of=(tuple(first_suffix), n))]
        self._rewind(k + 1)
        if len(self._segments) != k + 1:  # the rewind emptied the context instead
            raise EngineError("the context could not drop the end of a sequence")
        self._serial_segments = min(self._serial_segments, k)
        return evaluated

    def _memo_key(self, prefix: list[list[int]], suffix: Sequence[int], label_ids: Sequence[int]) -> bytes:
        """``readout.tokens_key``, with the prefix hashed once per request rather than once per question: the
        digest of the last prefix list seen is kept, by identity (``_execute`` builds one list per
        request and no one mutates it; holding the reference keeps its id from being reused)."""
        cached = self._memo_prefix
        if cached is None or cached[0] is not prefix:
            cached = self._memo_prefix = (prefix, tokens_digest(prefix))
        return tokens_digest((suffix, label_ids), cached[1].copy()).digest()

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
                      record: bool = False, lead: Optional[tuple[Sequence[int], int]] = None) -> Distribution:
        """``fuse``: evaluate the prefix's last segment and the suffix as one segment
        (PromptPlan.fuse_state_and_question); the memo keeps fused and split logits apart. ``record``:
        attach the recompute record (the segments as decoded; a memo hit was decoded the same way).
        ``lead``: (the first read's suffix, n): this read's first n suffix tokens are that suffix's, and are
        taken from its evaluation (``_hold_lead``); only the rest is evaluated. The memo keeps such reads apart."""
        label_ids = list(qplan.label_token_ids or ())
        variants = [list(v) for v in (qplan.label_variants or [(t,) for t in label_ids])]
        prefix_len = sum(len(s) for s in prefix)
        total = prefix_len + len(suffix)
        use_memo = self.label_memo and self.prefix_cache
        path = [] if lead is None else [-4, lead[1], *lead[0]]
        key = self._memo_key(prefix, suffix, [t for v in variants for t in v] + [-1] + [len(v) for v in variants]
                             + ([-2] if fuse else []) + path) if use_memo else b""
        remembered = self._label_memo.get(key) if use_memo else None
        redone = 0
        if remembered is not None:
            self._label_memo.move_to_end(key)
            logits, label_mass = remembered
            reused, evaluated = total, 0
        elif lead is not None:
            first_suffix, n = lead
            decoded = self._decoded_tokens
            redone = self._hold_lead(prefix, first_suffix, n)
            rows = self._decode(suffix[n:], {total - 1})
            evaluated = self._decoded_tokens - decoded
            reused = max(0, total - evaluated)
            logits, label_mass = label_logits(rows[total - 1], variants)
            if use_memo:
                self._label_memo[key] = (logits, label_mass)
                while len(self._label_memo) > LABEL_MEMO_SIZE:
                    self._label_memo.popitem(last=False)
        else:
            self._ensure_prefix(prefix)
            rows, reused, evaluated = self._forward(self._label_segments(prefix, suffix, fuse), [total - 1])
            logits, label_mass = label_logits(rows[total - 1], variants)
            if use_memo:
                self._label_memo[key] = (logits, label_mass)
                while len(self._label_memo) > LABEL_MEMO_SIZE:
                    self._label_memo.popitem(last=False)
        temperature = qplan.temperature
        recompute = None
        if record:
            if lead is not None:  # the first read's suffix, then this read from its lead on (replacing the rest)
                segments = (self._record_segments(prefix, lead[0])
                            + recompute_segments([suffix[lead[1]:]], start=prefix_len + lead[1]))
            elif fuse:
                segments = recompute_segments(self._label_segments(prefix, suffix, fuse))
            else:
                segments = self._record_segments(prefix, suffix)
            recompute = {"scoring": "label", "settings": dict(self.numerics), "segments": segments,
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
            redone_tokens=redone,
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
            logprobs = [float(token_logprobs(first_row, answer[:1])[0])]
            tail = answer[:-1]
            if tail:
                positions = list(range(prompt_len, prompt_len + len(tail)))
                rows, _, n_eval = self._forward(body + [tail], positions)
                evaluated += n_eval
                logprobs += token_logprobs(np.stack([rows[p] for p in positions]), answer[1:]).tolist()
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
