"""The SemIf schema: `POST /invocations` and `POST /v1/semif`.

    {"decision": {"id", "state", "question", "options": [{"id", "description"}]}}
    {"state": "...", "decisions": [{"id", "question", "options"}, ...]}   →  {"results": [...]}
"""

from __future__ import annotations

import os
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ..engine.context import ScoreResult
from ..engine.plan import MAX_READS
from ..engine.prompt import TEMPLATE_VERSION, Outcome, Question, options_sha256
from ..postprocess.policy import Policy, PolicyError
from .base import (Job, Limits, RequestError, RunContext, SecondLookBudget, SecondLookSpec, excerpt, first_validation_error,
                   option_description_problem, option_id_problem, resolve_layout)

NAME = "semif"
_MAX_TEXT = 200_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Option(_Strict):
    id: str = Field(min_length=1, max_length=256)
    description: Optional[str] = Field(default=None, max_length=4000)

    @field_validator("id")
    @classmethod
    def _no_control_characters(cls, value: str) -> str:
        problem = option_id_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("description")
    @classmethod
    def _no_hash_separators(cls, value: Optional[str]) -> Optional[str]:
        problem = option_description_problem(value)
        if problem:
            raise ValueError(problem)
        return value


class DecisionQuestion(_Strict):
    id: str = Field(min_length=1, max_length=256)
    question: str = Field(min_length=1, max_length=8000)
    options: list[Option] = Field(min_length=2)
    scoring: Optional[Literal["label", "sequence"]] = None
    # The option that escapes a forced choice ("needs_more_info", "none_of_these"): debias "content_free"
    # keeps its content-free share instead of dividing it out (engine/passes/prior.py content_free_shift).
    abstain_option: Optional[str] = Field(default=None, min_length=1, max_length=256)

    @field_validator("abstain_option")
    @classmethod
    def _abstain_is_an_option(cls, value: Optional[str], info: ValidationInfo) -> Optional[str]:
        options = info.data.get("options")  # absent when the options themselves failed: that error is reported
        if value is not None and options is not None and value not in {o.id for o in options}:
            raise ValueError(f"{excerpt(value)!r} is not one of the options' ids")
        return value

    @field_validator("question")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value

    @field_validator("options")
    @classmethod
    def _unique_ids(cls, options: list[Option]) -> list[Option]:
        seen: set[str] = set()
        for index, option in enumerate(options):
            if option.id in seen:
                raise ValueError(f"duplicate option id {excerpt(option.id)!r} at index {index}")
            seen.add(option.id)
        return options


class AbstentionPolicy(_Strict):
    """`{"min_probability", "min_margin", "fallback"}`: see semif/serving/postprocess/policy.py."""

    min_probability: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    min_margin: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    min_label_mass: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    fallback: Optional[str] = Field(default=None, min_length=1, max_length=256)
    max_injection: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    # A second look for the answers this policy would not accept, within this budget (contracts/base.py).
    second_look: Optional[SecondLookBudget] = None


class SingleDecision(DecisionQuestion):
    state: str = Field(min_length=1, max_length=_MAX_TEXT)


class SingleRequest(_Strict):
    decision: SingleDecision
    scoring: Optional[Literal["label", "sequence"]] = None
    return_prompt: bool = False
    policy: Optional[AbstentionPolicy] = None
    layout: Optional[Literal["state_first", "options_first"]] = None
    injection_check: Optional[bool] = None
    # Debiasing: "reverse" scores each decision in the given and the reversed option order (the second only
    # while the answer could still change) and combines them; "content_free" divides out the model's prior for each option (its answer for the state "N/A");
    # "rotations" reads the options in a canonical order and its rotations; None takes the server default
    # (SEMIF_DEBIAS).
    debias: Optional[Literal["none", "reverse", "content_free", "rotations"]] = None
    # debias "rotations" or "reverse": how many orders to read each decision in (the first one first); absent:
    # read while the combined answer could still change (engine/passes/orders.py, the stop rule).
    reads: Optional[int] = Field(default=None, ge=1, le=MAX_READS)
    # Opt-in: the model reasons within a budget before the label is read again, for ambiguous answers.
    second_look: Optional[SecondLookSpec] = None


class BatchRequest(_Strict):
    state: str = Field(min_length=1, max_length=_MAX_TEXT)
    decisions: list[DecisionQuestion] = Field(min_length=1)
    scoring: Optional[Literal["label", "sequence"]] = None
    return_prompt: bool = False
    policy: Optional[AbstentionPolicy] = None
    layout: Optional[Literal["state_first", "options_first"]] = None
    injection_check: Optional[bool] = None
    # Debiasing: "reverse" scores each decision in the given and the reversed option order (the second only
    # while the answer could still change) and combines them; "content_free" divides out the model's prior for each option (its answer for the state "N/A");
    # "rotations" reads the options in a canonical order and its rotations; None takes the server default
    # (SEMIF_DEBIAS).
    debias: Optional[Literal["none", "reverse", "content_free", "rotations"]] = None
    # debias "rotations" or "reverse": how many orders to read each decision in (the first one first); absent:
    # read while the combined answer could still change (engine/passes/orders.py, the stop rule).
    reads: Optional[int] = Field(default=None, ge=1, le=MAX_READS)
    # Opt-in: the model reasons within a budget before the label is read again, for ambiguous answers.
    second_look: Optional[SecondLookSpec] = None

    @model_validator(mode="after")
    def _unique_decision_ids(self) -> "BatchRequest":
        seen: set[str] = set()
        for decision in self.decisions:
            if decision.id in seen:
                raise ValueError(f"duplicate decision id {excerpt(decision.id)!r}")
            seen.add(decision.id)
        return self


def matches(body: Any) -> bool:
    return isinstance(body, dict) and ("decision" in body or "decisions" in body)


def _check_limits(decisions: list[DecisionQuestion], limits: Limits, prefix: str) -> None:
    if len(decisions) > limits.max_questions:
        raise RequestError(
            422, "too_many_questions", f"{len(decisions)} decisions; at most {limits.max_questions}", "decisions"
        )
    for index, decision in enumerate(decisions):
        if len(decision.options) > limits.max_options:
            field = f"{prefix}[{index}].options" if prefix == "decisions" else "decision.options"
            raise RequestError(
                422, "too_many_options", f"{len(decision.options)} options; at most {limits.max_options}", field
            )


def _question(decision: DecisionQuestion, fallback: Optional[str] = None) -> Question:
    """The engine's question. Its abstain option: the one the decision marks, else the policy's fallback when
    that names one of the decision's options (a fallback is where the caller goes when the answer is unsure)."""
    ids = [o.id for o in decision.options]
    escape = decision.abstain_option if decision.abstain_option is not None else fallback
    return Question(
        text=decision.question,
        outcomes=tuple(Outcome(o.id, o.description) for o in decision.options),
        kind="choice",
        abstain=ids.index(escape) if escape in ids else None,
    )


def parse(body: Any, limits: Limits) -> Job:
    if not isinstance(body, dict):
        raise RequestError(422, "invalid_request", "the body must be a JSON object", "<body>")
    if "decision" in body and "decisions" in body:
        raise RequestError(422, "invalid_request", "send either 'decision' or 'decisions', not both", "decision")
    single = "decision" in body
    try:
        request = SingleRequest.model_validate(body) if single else BatchRequest.model_validate(body)
    except ValidationError as exc:
        raise first_validation_error(exc) from None
    if single:
        decisions = [request.decision]
        state = request.decision.state
    else:
        decisions = request.decisions
        state = request.state
    if not state.strip():
        raise RequestError(422, "invalid_request", "state must not be blank", "decision.state" if single else "state")
    _check_limits(decisions, limits, "decision" if single else "decisions")
    scorings = {d.scoring or request.scoring for d in decisions}
    if len(scorings) > 1:
        raise RequestError(
            422, "invalid_request", "all decisions of one request use one scoring method", "decisions[].scoring"
        )
    scoring = scorings.pop()
    hashes = [options_sha256([(o.id, o.description) for o in d.options]) for d in decisions]

    def render(result: ScoreResult, run: RunContext) -> dict:
        results = []
        for decision, dist, opt_hash in zip(decisions, result.distributions, hashes):
            probabilities = dist.probabilities
            ranked = sorted(range(len(probabilities)), key=lambda i: -probabilities[i])
            top, second = ranked[0], ranked[1]
            prompt = {
                "tokens": dist.tokens,
                "cached_tokens": dist.cached_tokens,
                "evaluated_tokens": dist.evaluated_tokens,
                # The plan's version: the layout it ran, or a native decision model's "gguf:<sha256 prefix>".
                "template_version": getattr(result, "template_version", None) or run.model.get("template_version") or TEMPLATE_VERSION,
                "template_sha256": run.model.get("template_sha256"),
                "options_sha256": opt_hash,
                "layout": getattr(result, "layout", "state_first"),
            }
            prompt["debias"] = dist.debias
            if getattr(dist, "content_free", None) is not None:
                # The prior divided out and the raw answer it was divided out of (debias "content_free"); the
                # abstain option whose content-free share was kept, by its id.
                content_free = dict(dist.content_free)
                if content_free.get("abstain_kept") is not None:
                    content_free["abstain_kept"] = decision.options[content_free["abstain_kept"]].id
                prompt["content_free"] = content_free
            if getattr(dist, "reads", None) is not None:
                # debias "rotations": each read's order (option ids as shown) and answer (in the given order),
                # and why no further order was read.
                prompt["reads"] = [dict(read, order=[decision.options[i].id for i in read["order"]])
                                   for read in dist.reads]
            if getattr(dist, "reads_stopped", None) is not None:
                # debias "rotations" and "reverse": why no further order was read ("settled", "requested", "all").
                prompt["reads_stopped"] = dist.reads_stopped
            if getattr(dist, "temperature", None) is not None:
                prompt["temperature"] = dist.temperature  # the native model's own, applied to the logits
            if request.return_prompt:
                prompt["text"] = dist.prompt_text
                prompt["label_token_ids"] = dist.label_token_ids
                prompt["labels"] = dist.labels
                prompt["label_variant_ids"] = dist.label_variant_ids
                # What a fresh llama.cpp context decodes to reproduce option_logits (docs/adapter.md).
                prompt["recompute"] = getattr(dist, "recompute", None)
                if dist.orders is not None:
                    # Each order's own answer (outcomes in the given order), before they were combined; its
                    # order as the option ids it showed, first to last (as prompt.reads under rotations).
                    prompt["orders"] = {name: dict(read, order=[decision.options[i].id for i in read["order"]])
                                        for name, read in dist.orders.items()}
            entry = {
                    "id": decision.id,
                    "option_ids": [o.id for o in decision.options],
                    "probabilities": probabilities,
                    "option_logits": dist.option_logits,
                    "choice": decision.options[top].id,
                    "margin": probabilities[top] - probabilities[second],
                    # p(yes) of the injection check on this state, or null when it did not run.
                    "injection_suspected": getattr(dist, "injection_suspected", None),
                    "label_mass": dist.label_mass,
                    "prompt": prompt,
                    "timing": {
                        "queue_ms": round(run.queue_ms, 3),
                        "compute_ms": round(dist.compute_ms, 3),
                        "total_ms": round(run.total_ms, 3),
                    },
                    "model": _model_record(run, dist.scoring),
                }
            # Which pass decided, and the first pass's answer, when the request asked for a second look.
            if getattr(dist, "second_look", None) is not None:
                entry["second_look"] = dist.second_look
            results.append(entry)
            # Set by the HTTP layer's postprocessor (semif/serving/postprocess/policy.py) when a calibration or policy applies.
            if getattr(dist, "calibration", None) is not None:
                results[-1]["calibration"] = dist.calibration
            if getattr(dist, "action", None) is not None:
                results[-1]["action"] = dist.action
                results[-1]["action_reason"] = dist.action_reason
                if dist.action_fallback is not None:
                    results[-1]["fallback"] = dist.action_fallback
        if single:
            return {"request_id": run.request_id, **results[0]}
        # With return_prompt, what the decisions' prompts share (the state) is shown once, not once per decision.
        shared = {"prompt": shared_prompt(results, getattr(result, "prefix_text", None))} if request.return_prompt else {}
        return {
            "request_id": run.request_id,
            **shared,
            "results": results,
            "usage": {
                "input_tokens": result.input_tokens,
                "state_tokens": result.state_tokens,
                "cached_tokens": result.cached_tokens,
                "evaluated_tokens": result.evaluated_tokens,
            },
            "timing": {"queue_ms": round(run.queue_ms, 3), "compute_ms": round(run.compute_ms, 3), "total_ms": round(run.total_ms, 3)},
        }

    job = Job(
        state_text=state,
        questions=[_question(d, request.policy.fallback if request.policy is not None else None) for d in decisions],
        render=render,
        scoring=scoring,
        return_prompt=request.return_prompt,
        options_sha256=hashes,
        decision_ids=[d.id for d in decisions],
        state_field="decision.state" if single else "state",
        question_fields=["decision.options"] if single else [f"decisions[{i}].options" for i in range(len(decisions))],
        question_names=[d.id for d in decisions],
        budget_field="decision" if single else "decisions",
        layout=request.layout,
        injection_check=request.injection_check,
        layout_field="layout",
        debias=request.debias,
        reads=request.reads,
    )
    resolve_layout(job, "state_first")  # an explicit options_first with several decisions: 422 now
    if request.second_look is not None:
        job.second_look = request.second_look.config()
    if request.policy is not None:
        policy = request.policy.model_dump(exclude_none=True, exclude={"second_look"})
        if request.policy.second_look is not None and job.second_look is None:
            budget = request.policy.second_look
            job.second_look = budget.config(policy)
            job.second_look_field = "policy.second_look"
        try:  # the policy module's own rules, checked now: never after the model has done the work
            Policy.from_mapping(policy)
        except PolicyError as exc:
            raise RequestError(422, "invalid_request", f"{exc.field}: {exc}", exc.field) from None
        job.policy = policy  # read by semif/serving/postprocess/policy.py's postprocessor
    return job


def shared_prompt(results: list[dict], prefix_text: Optional[str]) -> dict:
    """A batch's decisions share their state: with return_prompt, the text and the token segments that all
    their prompts start with are moved out of the results (rewritten in place) into one block,
    ``{"text", "segments"}``. Each prompt text (`prompt.text`, each `prompt.orders.*.prompt_text`) keeps what
    follows `text`; each recompute record (`prompt.recompute`, its `reads`, `second_look.first_pass.recompute`)
    keeps the segments that follow the first `request_prompt_segments` of `segments`. So a response grows with the
    decisions' own prompts, never with one copy of the state per decision."""
    texts: list[tuple[dict, str]] = []
    records: list[tuple[Any, Any]] = []  # (holder, key): a dict and its key, or a list of reads and an index
    for entry in results:
        prompt = entry["prompt"]
        texts.append((prompt, "text"))
        if prompt.get("orders"):
            prompt["orders"] = {name: dict(read) for name, read in prompt["orders"].items()}
            texts.extend((read, "prompt_text") for read in prompt["orders"].values() if "prompt_text" in read)
        if prompt.get("recompute"):
            records.append((prompt, "recompute"))
        first_pass = (entry.get("second_look") or {}).get("first_pass")
        if first_pass and first_pass.get("recompute"):
            entry["second_look"] = dict(entry["second_look"], first_pass=dict(first_pass))
            records.append((entry["second_look"]["first_pass"], "recompute"))
    for holder, key in records:  # copies: the engine may hand one record to several places
        holder[key] = dict(holder[key])
        if holder[key].get("reads"):  # reads in several orders: each one's record, in its list
            holder[key]["reads"] = list(holder[key]["reads"])
            records.extend((holder[key]["reads"], index) for index in range(len(holder[key]["reads"])))
    candidates = [holder[key] for holder, key in texts if holder.get(key) is not None]
    text = os.path.commonprefix(candidates + ([prefix_text] if prefix_text is not None else [])) if candidates else ""
    for holder, key in texts:
        if holder.get(key) is not None:
            holder[key] = holder[key][len(text):]
    lists = [holder[key]["segments"] for holder, key in records]
    # Whole segments, and never a record's last one (its question): the shared ones end where the state does.
    count = min((len(segments) - 1 for segments in lists), default=0)
    while count > 0 and any(segments[:count] != lists[0][:count] for segments in lists[1:]):
        count -= 1
    segments = lists[0][:count] if lists else []
    for holder, key in records:
        holder[key]["segments"] = holder[key]["segments"][count:]
        holder[key]["request_prompt_segments"] = count
    return {"text": text, "segments": segments}


def _model_record(run: RunContext, scoring: str) -> dict:
    info = run.model
    return {
        "file": info["file"],
        "sha256": info["sha256"],
        "llama_cpp_python": info["llama_cpp_python"],
        "llama_cpp_build": info["llama_cpp_build"],
        "n_gpu_layers": info["n_gpu_layers"],
        "flash_attn": info.get("flash_attn"),
        "hardware": info["hardware"],
        "scoring": scoring,
        "image_digest": run.image_digest,
        "base_image_digest": info.get("base_image_digest"),
    }


def error_body(error: RequestError) -> dict:
    return {"error": {"code": error.code, "message": error.message, "field": error.field}}
