"""Several sequences per decode (opt-in: SEMIF_BATCHING=1, SEMIF_N_SEQ=N; docs/reference/configuration.md).

The default engine path is serial and batch-invariant: every question is decoded alone, so an answer
never depends on other questions or other clients. This module is the other path, for throughput:

- ``enable_parallel_sequences`` gives the engine's llama.cpp context ``n_seq_max = N`` sequences in one
  unified KV buffer (so a prefix copied to another sequence is shared, not duplicated, and each
  sequence may use the whole context);
- ``execute_batch`` runs the label-scored questions of one or more plans together: each distinct state
  prefix is evaluated once (all of them in one batch), copied to the sequences of its other questions
  with ``llama_memory_seq_cp``, and every question's suffix goes into one ``llama_batch`` with its own
  sequence id and positions; each question's answer is read from its last position's logits;
- ``BatchCollector`` (``semif.serving.http.batch_collector``) sits beside the HTTP layer's ``Admission``:
  it takes the requests waiting for the model and hands them to ``execute_batch`` in one go.

Batch shape changes the kernels' float accumulation, so batched answers drift from serial ones
(measured in docs/benchmarks.md, "Batching"), and with the collector one client's
answer depends on which other requests shared its decode. Plans the batched path cannot run (``batchable``
is False: sequence scoring, order debiasing, the injection check, a second look, models that cannot
rewind a sequence partially) go through the serial ``Engine.execute``; the collector hands each of them
over alone, so that no batch waits for one.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence


from .passes import prior
from .plan import PromptPlan, QuestionPlan

MAX_N_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ; llama_max_parallel_sequences() says it at run time


def enable_parallel_sequences(llm, n_seq: int, *, verbose: bool = False) -> None:
    """Replace ``llm``'s llama.cpp context by one with ``n_seq`` sequences in a unified KV buffer.

    llama-cpp-python 0.3.36's ``Llama(...)`` has no ``n_seq_max`` argument (it sets one only for
    embeddings), so the context it made is freed and a new one is created from the same parameters
    with ``n_seq_max`` and ``kv_unified`` set. The new context frees itself before the model, like
    the one it replaces. Without ``kv_unified`` llama.cpp would split the context into ``n_seq``
    streams of ``n_ctx / n_seq`` cells each, and a copied prefix would be copied, not shared."""
    import llama_cpp
    from llama_cpp._internals import LlamaContext

    limit = int(llama_cpp.llama_max_parallel_sequences())
    if not 1 < n_seq <= limit:
        raise ValueError(f"n_seq={n_seq} must be between 2 and {limit} (llama_max_parallel_sequences)")
    params = llm.context_params
    params.n_seq_max = n_seq
    params.kv_unified = True
    llm._ctx.close()  # free the old KV buffer first: the two never coexist in memory
    llm._ctx = LlamaContext(model=llm._model, params=params, verbose=verbose)


# ---- one batched execution on the model thread ------------------------------------------------------


@dataclass
class _Item:
    """One question of one plan, waiting for a sequence."""

    plan: int
    index: int
    qplan: QuestionPlan
    suffix: list[int]
    seq: int = -1


@dataclass
class _Account:
    """What one plan has received so far."""

    plan: PromptPlan
    cancel: Optional[Callable[[], bool]]
    distributions: list = field(default_factory=list)
    evaluated: int = 0
    state_cached: Optional[int] = None
    done: int = 0
    error: Optional[BaseException] = None
    shared_with: set = field(default_factory=set)  # other plans that shared one of its decodes
    priors: Any = None  # debias "content_free": its priors, held or evaluated serially before the waves


@dataclass
class BatchStats:
    """Counters for tests, logs and benchmarks."""

    batches: int = 0  # execute_batch calls
    waves: int = 0  # groups of questions decoded together (at most n_seq questions each)
    shared_waves: int = 0  # waves that held questions of more than one plan (request)
    requests: int = 0  # plans that went through execute_batch
    serial_fallbacks: int = 0  # plans execute_batch handed to the serial path


def batchable(engine, plan: PromptPlan) -> bool:
    """Label scoring on a context with several sequences and partial rewinds (recurrent and hybrid
    models cannot drop a sequence's tail, so they keep the serial path)."""
    return (
        getattr(engine, "n_seq", 1) > 1
        and engine.partial_rewind
        and plan.scoring == "label"
        and len(plan.questions) > 0
        and all(len(q.suffix_tokens) > 0 for q in plan.questions)
        # Order debiasing, the injection check and native temperatures take the serial path: a batched
        # step reads one label row per question from one shared prefix.
        and plan.injection_check is None
        and plan.second_look is None
        # Reads in several orders (each read decides whether the next is read) and their first read's order
        # (put back in the given order by the pass): serial, whatever `reads` asked.
        and getattr(plan, "debias", "none") not in ("rotations", "reverse")
        and all(q.reversed is None and q.temperature is None and q.own_prefix_segments is None for q in plan.questions)
    )


def execute_batch(engine, plans: Sequence[PromptPlan], cancels: Optional[Sequence[Optional[Callable[[], bool]]]] = None) -> list[Any]:
    """Run ``plans`` together; return, per plan, its ``ScoreResult`` or the exception it ended with
    (``Cancelled`` when its cancel hook said stop between two waves). An engine failure empties the
    context (as ``Engine.execute`` does) and is returned for every plan still running."""
    from .results import Cancelled

    stats: BatchStats = engine.batch_stats
    stats.batches += 1
    started = time.perf_counter()
    cancels = list(cancels) if cancels is not None else [None] * len(plans)
    outcomes: list[Any] = [None] * len(plans)
    serial = [i for i, plan in enumerate(plans) if not batchable(engine, plan)]
    accounts = {i: _Account(plan, cancels[i], [None] * len(plan.questions)) for i, plan in enumerate(plans) if i not in serial}
    stats.requests += len(plans)
    queue = collections.deque(
        _Item(i, q, qplan, list(qplan.suffix_tokens)) for i, acc in accounts.items() for q, qplan in enumerate(acc.plan.questions)
    )
    with engine.lock:
        try:
            if not engine.prefix_cache:
                engine.invalidate()
            # debias "content_free": a prior not held yet is evaluated first, on the serial path (exact, and
            # kept for the next request); the questions themselves then share the waves like any other.
            for acc in accounts.values():
                if acc.plan.content_free is not None:
                    try:
                        acc.priors = prior.evaluate_alone(engine, acc.plan, acc.cancel)
                    except Exception as failed:  # this request's own failure (the context was emptied): the others go on
                        acc.error = failed
            while queue:
                wave = _take_wave(engine, queue, accounts, Cancelled)
                if wave:
                    _run_wave(engine, wave, accounts)
        except BaseException as exc:
            engine.invalidate()
            for acc in accounts.values():
                acc.error = acc.error or exc
    elapsed_ms = (time.perf_counter() - started) * 1000
    for i, acc in accounts.items():
        if acc.error is not None:
            outcomes[i] = acc.error
        else:
            outcomes[i] = _result(acc, elapsed_ms)
            if acc.priors is not None:
                outcomes[i] = prior.apply_to_result(outcomes[i], acc.priors)
    for i in serial:  # exact serial path, after the batch (it takes the engine lock itself)
        stats.serial_fallbacks += 1
        try:
            outcomes[i] = engine.execute(plans[i], cancel=cancels[i])
        except Exception as exc:
            outcomes[i] = exc
    return outcomes


def _take_wave(engine, queue: "collections.deque[_Item]", accounts: dict, cancelled_error) -> list[_Item]:
    """Up to ``n_seq`` questions from the front of the queue whose KV cells fit the context together:
    each distinct prefix once, plus every suffix. A plan whose cancel hook says stop leaves the queue."""
    wave: list[_Item] = []
    prefixes: set = set()
    cells = 0
    asked: set[int] = set()
    while queue and len(wave) < engine.n_seq:
        item = queue[0]
        acc = accounts[item.plan]
        if acc.error is not None:
            queue.popleft()
            continue
        if item.plan not in asked:
            asked.add(item.plan)
            if acc.cancel is not None and acc.cancel():
                acc.error = cancelled_error(acc.done, len(acc.plan.questions))
                continue
        key = acc.plan.prefix_segments
        need = len(item.suffix) + (0 if key in prefixes else acc.plan.state_tokens)
        if wave and cells + need > engine.n_ctx:
            break
        cells += need
        prefixes.add(key)
        wave.append(queue.popleft())
    return wave


def _leading_match(held: list[tuple[int, ...]], wanted: Sequence[Sequence[int]]) -> int:
    keep = 0
    while keep < min(len(held), len(wanted)) and held[keep] == tuple(wanted[keep]):
        keep += 1
    return keep


def _run_wave(engine, wave: list[_Item], accounts: dict) -> None:
    wave_started = time.perf_counter()
    groups: dict[tuple, list[_Item]] = {}
    for item in wave:
        groups.setdefault(accounts[item.plan].plan.prefix_segments, []).append(item)
    keys = list(groups)
    # Sequence 0 holds what the context kept from before: the prefix that matches most of it goes there.
    held_before = engine.held_segments()
    matches = [_leading_match(held_before, key) for key in keys]
    first = max(range(len(keys)), key=lambda g: (matches[g], -g))
    order = [first] + [g for g in range(len(keys)) if g != first]
    seq = 0
    for g in order:
        for item in groups[keys[g]]:
            item.seq = seq
            seq += 1
    held = engine.keep_segments(matches[first])  # may empty the context (then nothing is reused)
    # Leading segments the context still holds (the template head, at least, once warm) are shared with
    # every other prefix that starts with them: their cells get the other home sequence too, before
    # sequence 0 grows. Without this each extra state would re-evaluate the template head.
    starts: dict[int, int] = {}
    for g in order:
        shared = min(matches[g], held)
        starts[g] = sum(len(segment) for segment in keys[g][:shared])
        home = groups[keys[g]][0].seq
        if g != first and starts[g] > 0:
            engine.copy_sequence(0, home, 0, starts[g])

    # 1. Every prefix's remaining tokens, all in one batch (split at n_batch), each on its home sequence.
    entries: list[tuple[int, int, int, Optional[int]]] = []  # (token, position, sequence, wave index or None)
    for g in order:
        tokens = [t for segment in keys[g] for t in segment]
        home = groups[keys[g]][0].seq
        entries += [(tokens[p], p, home, None) for p in range(starts[g], len(tokens))]
    engine.decode_entries(entries, {})
    # 2. The prefix to the other questions' sequences: in a unified KV buffer the cells are shared.
    for g in order:
        home, *others = groups[keys[g]]
        for item in others:
            engine.copy_sequence(home.seq, item.seq)
    # 3. Every suffix in one batch, logits at each question's last position.
    entries, wanted = [], {}
    for n, item in enumerate(wave):
        plen = accounts[item.plan].plan.state_tokens
        last = len(item.suffix) - 1
        entries += [(t, plen + j, item.seq, n if j == last else None) for j, t in enumerate(item.suffix)]
        ids = item.qplan.label_token_ids or ()
        wanted[n] = [list(v) for v in (item.qplan.label_variants or [(t,) for t in ids])]
    logits = engine.decode_entries(entries, wanted)
    wave_ms = (time.perf_counter() - wave_started) * 1000

    # 4. Book the answers.
    from .results import Distribution, softmax

    plans_in_wave = {item.plan for item in wave}
    for g in order:
        items = groups[keys[g]]
        plen = accounts[items[0].plan].plan.state_tokens
        for k, item in enumerate(items):
            acc = accounts[item.plan]
            cached = starts[g] if k == 0 else plen
            evaluated = (plen - starts[g] if k == 0 else 0) + len(item.suffix)
            n = wave.index(item)
            label_logits, label_mass = logits[n]
            acc.distributions[item.index] = Distribution(
                option_logits=label_logits, probabilities=softmax(label_logits), tokens=plen + len(item.suffix),
                cached_tokens=cached, evaluated_tokens=evaluated, scoring="label",
                label_token_ids=list(item.qplan.label_token_ids or ()), labels=list(item.qplan.labels or ()),
                label_mass=label_mass, label_variant_ids=wanted[n],
                prompt_text=(acc.plan.prefix_text + item.qplan.text) if acc.plan.return_prompt else None,
                compute_ms=wave_ms,
            )
            acc.evaluated += evaluated
            acc.done += 1
            acc.state_cached = cached if acc.state_cached is None else min(acc.state_cached, cached)
            acc.shared_with |= plans_in_wave - {item.plan}
    stats = engine.batch_stats
    stats.waves += 1
    stats.shared_waves += len(plans_in_wave) > 1

    # 5. Keep one prefix in sequence 0 (the last question's: its plan may continue in the next wave,
    #    and the next request may share its state) and empty every other sequence.
    last = wave[-1]
    engine.settle_sequences(last.seq, accounts[last.plan].plan.prefix_segments, len(wave))


def _result(acc: _Account, elapsed_ms: float):
    from .results import ScoreResult

    state_cached = acc.state_cached or 0
    result = ScoreResult(
        distributions=acc.distributions, state_tokens=acc.plan.state_tokens, input_tokens=acc.plan.input_tokens,
        cached_tokens=state_cached, evaluated_tokens=acc.evaluated, compute_ms=elapsed_ms,
        state_cached_tokens=state_cached, template_version=acc.plan.template_version, layout=acc.plan.layout,
        prefix_text=acc.plan.prefix_text if acc.plan.return_prompt else None,
    )
    result.batch_requests = 1 + len(acc.shared_with)
    return result
