"""Native decision models: GGUFs that carry their own decision prompt, labels and temperatures.

When the loaded GGUF says how it wants to be asked, the engine uses that instead of the SemIf template
(docs/explanation/scoring.md, "Native decision models"). Two published conventions are read:

- llama.cpp's decision server (`tools/server/server-decision.cpp`, route `/v1/systemone`):
  `<arch>.decision.type` names the readout; the prompt is the chat template named `systemone`
  (`tokenizer.chat_template.systemone`, Jinja, given `id`, `type`, `instructions`, `state`, `options`
  as `{key, description, label}` and `images`); temperatures are
  `<arch>.decision.temperature.<choice|score|noul>[.<bucket>]`, buckets `2`, `3_5`, `6_10`, `11` by
  option count. The label readouts are supported: `openjev` (one letter per option, A-Z then a-z,
  `true` first for a noul), `nimble` and `pplx_decider` (A-Z then AA-ZZ, single tokens only, written in
  each option's `label`). Types that read hidden states or need two orders and a rating scale (`lev`,
  `kev`, `laya`, `clef`, `lfm2_d1`, `lfm2_d1_omni`) are refused at load: scoring them by label logits
  would give wrong answers without saying so.
- jev-compatible-server (PyPI `jev-compatible-server`): `decision.prompt_template` (Python
  `str.format` with `{state}`, `{question_name}`, `{instructions}` and `{criteria}`), `decision.tokens`
  (a JSON object: label -> token id; the labels are a choice's option ids, a score's level numbers
  `"0"`…, a noul's `"true"`/`"false"`) and `decision.temperature` (one positive number).

Client text (the state, instructions, option ids and descriptions) is tokenized as plain text, the
model's template text with special tokens: the template is rendered with marker strings in place of
client values and split at them (a template that transforms its values is refused at load).
Knows tokens, not llama.cpp contexts or HTTP.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .plan import LabelError, Piece, PlanError, PromptPlan, PromptTooLong, QuestionPlan, TokenBudgetExceeded
from .prompt import Outcome, Question

Tokenize = Callable[..., list]

UPSTREAM_LABEL_TYPES = ("openjev", "nimble", "pplx_decider")
UPSTREAM_REFUSED_TYPES = ("lev", "kev", "laya", "clef", "lfm2_d1", "lfm2_d1_omni")
QUESTION_TYPE = {"choice": "choice", "binary": "noul", "scale": "score"}
JEV_FIELDS = ("state", "question_name", "instructions", "criteria")

_MARK = re.compile("\ue000([0-9]+)\ue001")


class ScoringUnsupported(LabelError):
    """A request for a scoring method a native decision model does not offer (a 422 naming `scoring`)."""

    code = "unsupported_scoring"


class NativeDecisionError(ValueError):
    """The GGUF carries decision metadata this adapter cannot honour (the model is refused at load)."""


@dataclass(frozen=True)
class NativeDecision:
    source: str  # "llama.cpp" | "jev"
    kind: str  # llama.cpp's decision type, or "prompt_template" for jev
    template: str
    temperatures: Mapping[str, float]
    token_map: Optional[Mapping[str, int]] = None  # jev: label -> token id
    label_codes: tuple[tuple[str, int], ...] = ()  # llama.cpp: label text and token, in option order
    labels_in_options: bool = False  # llama.cpp: the template is given each option's label
    noul_true_first: bool = True
    add_bos: bool = True
    sha256: str = field(default="", compare=False)

    @property
    def template_version(self) -> str:
        return f"gguf:{self.sha256[:16]}"

    def describe(self) -> dict:
        return {"source": self.source, "type": self.kind, "template_version": self.template_version,
                "template_sha256": self.sha256, "temperatures": dict(self.temperatures),
                "labels": len(self.token_map) if self.token_map is not None else len(self.label_codes)}

    # ---- answers ----------------------------------------------------------------------------

    def temperature(self, question: Question) -> float:
        if self.source == "jev":
            return self.temperatures.get("", 1.0)
        n = len(question.outcomes)
        bucket = "2" if n <= 2 else "3_5" if n <= 5 else "6_10" if n <= 10 else "11"
        kind = QUESTION_TYPE[question.kind]
        for name in (f"{kind}.{bucket}", kind):
            if name in self.temperatures:
                return self.temperatures[name]
        return 1.0

    def _upstream_order(self, question: Question) -> list[int]:
        """Indices of ``question.outcomes`` in the order llama.cpp shows them (a noul: false, true unless
        the type puts true first). SemIf's binary outcomes are (true, false)."""
        order = list(range(len(question.outcomes)))
        return order if question.kind != "binary" or self.noul_true_first else order[::-1]

    def labels(self, question: Question, *, field: str, name: str) -> tuple[list[str], list[int]]:
        """Label texts and token ids, one per outcome in ``question.outcomes`` order."""
        n = len(question.outcomes)
        if self.token_map is not None:
            if question.kind == "binary":
                texts = ["true", "false"]
            elif question.kind == "scale":
                texts = [str(i) for i in range(n)]
            else:
                texts = [o.key for o in question.outcomes]
            missing = [t for t in texts if t not in self.token_map]
            if missing:
                raise LabelError(f"question {name!r}: this native decision model has no token for label(s) "
                                 f"{', '.join(repr(m) for m in missing[:5])} (decision.tokens)", field=field)
            return texts, [self.token_map[t] for t in texts]
        if n > len(self.label_codes):
            raise LabelError(f"question {name!r}: this native decision model ({self.kind}) supports at most "
                             f"{len(self.label_codes)} options (got {n})", field=field)
        texts, ids = [""] * n, [0] * n
        for slot, index in enumerate(self._upstream_order(question)):
            texts[index], ids[index] = self.label_codes[slot]
        return texts, ids

    # ---- prompt -----------------------------------------------------------------------------

    def render(self, state_text: str, question: Question, name: str) -> list[tuple[str, str]]:
        """The prompt as (role, text) pieces: role "template" for the model's own text, "state" and
        "question" for client text."""
        values: list[tuple[str, str]] = []

        def mark(role: str, text: str) -> str:
            values.append((role, text))
            return f"\ue000{len(values) - 1}\ue001"

        if self.source == "jev":
            rendered = self._render_jev(state_text, question, name, mark)
        else:
            rendered = self._render_upstream(state_text, question, name, mark)
        pieces: list[tuple[str, str]] = []
        last = 0
        for match in _MARK.finditer(rendered):
            if match.start() > last:
                pieces.append(("template", rendered[last : match.start()]))
            pieces.append(values[int(match.group(1))])
            last = match.end()
        if last < len(rendered):
            pieces.append(("template", rendered[last:]))
        if any("\ue000" in text or "\ue001" in text for role, text in pieces if role == "template"):
            raise NativeDecisionError("the decision template altered a value it was given; cannot tell its text from the client's")
        # A BPE pre-tokenizer attaches whitespace to the word after it ("Criteria: {criteria}" is `:`,
        # ` {'`; "\n\nWhich" is `\n`, `\n`, `Which`): whitespace that ends template text before a client
        # value goes with the value (whitespace is plain text), so the pieces' tokens match the whole
        # prompt's at that boundary.
        for i in range(len(pieces) - 1):
            (role, text), (next_role, next_text) = pieces[i], pieces[i + 1]
            if role == "template" and next_role != "template" and next_text:
                kept = text.rstrip()
                pieces[i], pieces[i + 1] = (role, kept), (next_role, text[len(kept):] + next_text)
        return [(role, text) for role, text in pieces if text]

    def _render_jev(self, state_text: str, question: Question, name: str, mark) -> str:
        if question.kind == "binary":
            criteria: object = {o.key: o.description for o in question.outcomes if o.description}
        elif question.kind == "scale":
            criteria = [o.key for o in question.outcomes]
        else:
            criteria = {o.key: o.description or "" for o in question.outcomes}
        values = {"state": mark("state", state_text), "question_name": mark("question", name),
                  "instructions": mark("question", question.text), "criteria": mark("question", str(criteria))}
        return self.template.format(**values)

    def _render_upstream(self, state_text: str, question: Question, name: str, mark) -> str:
        order = self._upstream_order(question)
        if question.kind == "binary":
            keys = ["true", "false"]
        elif question.kind == "scale":
            keys = [str(i) for i in range(len(question.outcomes))]
        else:
            keys = [o.key for o in question.outcomes]
        options = []
        for slot, index in enumerate(order):
            outcome: Outcome = question.outcomes[index]
            description = outcome.key if question.kind == "scale" else outcome.description
            option = {"key": mark("question", keys[index]),
                      "description": mark("question", description) if description is not None else None}
            if self.labels_in_options:
                option["label"] = self.label_codes[slot][0]
            options.append(option)
        inputs = {"id": mark("question", name), "type": QUESTION_TYPE[question.kind],
                  "instructions": mark("question", question.text), "state": mark("state", state_text),
                  "options": options, "images": []}
        if self.kind == "nimble":
            inputs["questions"] = [{k: inputs[k] for k in ("id", "type", "instructions", "options")}]
        return _compile(self.template).render(**inputs)


def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, loader=jinja2.BaseLoader())
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(jinja2.exceptions.TemplateError(message))
    return env.from_string(template)


def _positive(key: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise NativeDecisionError(f"invalid decision temperature: {key} = {raw!r}") from None
    if not value > 0:
        raise NativeDecisionError(f"invalid decision temperature: {key} = {raw!r} (must be > 0)")
    return value


def read_native_decision(metadata: Mapping[str, str], tokenize: Tokenize, *, n_vocab: Optional[int] = None) -> Optional[NativeDecision]:
    """The GGUF's own decision setup, or None when it carries none. Raises NativeDecisionError for
    decision metadata that cannot be honoured (better no model than silently wrong answers). ``n_vocab``:
    the model's vocabulary size, which every label token id must be below."""
    arch = metadata.get("general.architecture", "")
    upstream_type = metadata.get(f"{arch}.decision.type") if arch else None
    if upstream_type is not None:
        return _read_upstream(metadata, arch, upstream_type, tokenize)
    if "decision.prompt_template" in metadata or "decision.tokens" in metadata:
        return _read_jev(metadata, n_vocab)
    return None


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _read_upstream(metadata: Mapping[str, str], arch: str, kind: str, tokenize: Tokenize) -> NativeDecision:
    if kind in UPSTREAM_REFUSED_TYPES:
        raise NativeDecisionError(
            f"decision model type {kind!r} ({arch}.decision.type) reads hidden states or several orders and a "
            f"rating scale; this adapter scores label logits and supports {', '.join(UPSTREAM_LABEL_TYPES)}")
    if kind not in UPSTREAM_LABEL_TYPES:
        raise NativeDecisionError(f"unsupported decision model type {kind!r} ({arch}.decision.type)")
    template = metadata.get("tokenizer.chat_template.systemone")
    if not template:
        raise NativeDecisionError('decision model has no "systemone" template (tokenizer.chat_template.systemone)')
    try:
        _compile(template)
    except jinja2.exceptions.TemplateError as exc:
        raise NativeDecisionError(f"the systemone template does not compile: {exc}") from None
    prefix = f"{arch}.decision.temperature."
    temperatures = {key[len(prefix):]: _positive(key, value) for key, value in metadata.items() if key.startswith(prefix)}
    codes: list[tuple[str, int]] = []
    if kind == "openjev":
        for letter in string.ascii_uppercase + string.ascii_lowercase:
            tokens = tokenize(letter, special=False)
            if len(tokens) != 1:
                raise NativeDecisionError(f"decision label {letter!r} is not a single token")
            codes.append((letter, tokens[0]))
    else:
        candidates = list(string.ascii_uppercase) + [a + b for a in string.ascii_uppercase for b in string.ascii_uppercase]
        for code in candidates:
            tokens = tokenize(code, special=False)
            if len(tokens) == 1 and len(codes) < 255:
                codes.append((code, tokens[0]))
    native = NativeDecision(
        source="llama.cpp", kind=kind, template=template, temperatures=temperatures, label_codes=tuple(codes),
        labels_in_options=kind != "openjev", noul_true_first=kind == "openjev", add_bos=False,
    )
    native = _with_digest(native)
    _probe(native)
    return native


def _read_jev(metadata: Mapping[str, str], n_vocab: Optional[int]) -> NativeDecision:
    template = metadata.get("decision.prompt_template")
    if not template:
        raise NativeDecisionError("model metadata must define a string decision.prompt_template")
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise NativeDecisionError(f"decision.prompt_template is not a format string: {exc}") from None
    unknown = fields - set(JEV_FIELDS)
    if unknown:
        raise NativeDecisionError(f"decision.prompt_template uses unknown field(s) {sorted(unknown)}; known: {', '.join(JEV_FIELDS)}")
    raw_tokens = metadata.get("decision.tokens")
    if raw_tokens is None:
        raise NativeDecisionError("decision.prompt_template needs decision.tokens (label -> token id)")
    try:
        token_map = json.loads(raw_tokens)
    except json.JSONDecodeError:
        raise NativeDecisionError("decision.tokens is not valid JSON") from None
    if not isinstance(token_map, dict) or not token_map or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0 for k, v in token_map.items()
    ):
        raise NativeDecisionError("decision.tokens must be a JSON object mapping labels to token ids")
    if n_vocab is not None:
        outside = {label: token for label, token in token_map.items() if token >= n_vocab}
        if outside:
            label, token = next(iter(outside.items()))
            raise NativeDecisionError(f"decision.tokens: label {label!r} has token id {token}, beyond the vocabulary "
                                      f"({n_vocab} tokens: ids 0 to {n_vocab - 1})")
    by_token: dict[int, str] = {}
    for label, token in token_map.items():
        if token in by_token:  # two outcomes read from one logit would always score alike
            raise NativeDecisionError(f"decision.tokens: labels {by_token[token]!r} and {label!r} have the same token id {token}")
        by_token[token] = label
    temperatures = {}
    if "decision.temperature" in metadata:
        temperatures[""] = _positive("decision.temperature", metadata["decision.temperature"])
    native = _with_digest(NativeDecision(source="jev", kind="prompt_template", template=template,
                                         temperatures=temperatures, token_map=token_map))
    _probe(native)
    return native


def _with_digest(native: NativeDecision) -> NativeDecision:
    digest = _digest(native.source, native.kind, native.template, dict(native.temperatures),
                     dict(native.token_map or {}), list(native.label_codes))
    return dataclasses.replace(native, sha256=digest)


def _probe(native: NativeDecision) -> None:
    """Render each question type once at load, so a template that cannot be split is refused then."""
    probes = [Question("q", (Outcome("a", "d"), Outcome("b"))), Question("q", (Outcome("true"), Outcome("false")), kind="binary"),
              Question("q", (Outcome("low"), Outcome("high")), kind="scale")]
    for question in probes:
        try:
            pieces = native.render("s", question, "id")
        except (jinja2.exceptions.TemplateError, KeyError, IndexError, TypeError) as exc:
            raise NativeDecisionError(f"the decision template does not render: {exc}") from None
        if not any(role == "state" for role, _ in pieces):
            raise NativeDecisionError("the decision template does not show the state")


def build_native_plan(
    *,
    native: NativeDecision,
    tokenize: Tokenize,
    n_ctx: int,
    n_batch: int,
    state_text: str,
    questions: Sequence[Question],
    state_field: str = "state",
    question_fields: Optional[Sequence[str]] = None,
    question_names: Optional[Sequence[str]] = None,
    budget_field: str = "questions",
    max_request_tokens: Optional[int] = None,
    return_prompt: bool = False,
) -> PromptPlan:
    """A plan from the model's own template. The prompt is split at the end of the state when every
    question's prompt starts with the same template text and the state (then the state is evaluated once
    per request, as with the SemIf template); otherwise each question's prompt is evaluated whole."""
    fields = list(question_fields) if question_fields is not None else [f"questions[{i}]" for i in range(len(questions))]
    names = list(question_names) if question_names is not None else [str(i) for i in range(len(questions))]
    rendered = []
    for question, fld, name in zip(questions, fields, names):
        label_texts, label_ids = native.labels(question, field=fld, name=name)
        rendered.append((question, fld, name, native.render(state_text, question, name), label_texts, label_ids))

    def head_through_state(pieces: list[tuple[str, str]]) -> Optional[tuple]:
        for i, (role, _) in enumerate(pieces):
            if role == "state":
                return tuple(pieces[: i + 1])
            if role != "template":
                return None
        return None

    heads = {head_through_state(r[3]) for r in rendered}
    shared = heads.pop() if len(heads) == 1 else None
    first_bos = [native.add_bos]

    def piece(role: str, text: str) -> Piece:
        special = role == "template"
        add_bos = first_bos[0]
        first_bos[0] = False
        return Piece(role, text, tuple(tokenize(text, special=special, add_bos=add_bos)), special)

    prefix_pieces: tuple[Piece, ...] = tuple(piece(role, text) for role, text in shared) if shared else ()
    segments: list[tuple[int, ...]] = []
    head = [t for p in prefix_pieces[:-1] for t in p.tokens]
    if head:
        segments.append(tuple(head))
    if prefix_pieces:
        state_tokens = prefix_pieces[-1].tokens
        segments += [tuple(state_tokens[i : i + n_batch]) for i in range(0, len(state_tokens), n_batch)]
    prefix_len = sum(len(s) for s in segments)

    planned = []
    bos_after_prefix = first_bos[0]
    for question, fld, name, pieces, label_texts, label_ids in rendered:
        first_bos[0] = bos_after_prefix
        own = pieces[len(shared):] if shared else pieces
        qpieces = tuple(piece(role, text) for role, text in own)
        plan = QuestionPlan(question=question, field=fld, name=name, pieces=qpieces,
                            label_token_ids=tuple(label_ids), labels=tuple(label_texts),
                            temperature=native.temperature(question))
        need = prefix_len + len(plan.suffix_tokens)
        if not plan.suffix_tokens:
            raise PlanError(f"question {name!r}: the decision template leaves nothing after the state", field=fld)
        if need > n_ctx:
            if len(plan.suffix_tokens) > prefix_len:
                raise PromptTooLong(need, n_ctx, field=fld, what=f"question {name!r}")
            raise PromptTooLong(need, n_ctx, field=state_field, what="the state")
        planned.append(plan)

    result = PromptPlan(
        state_text=state_text, scoring="label", template_version=native.template_version,
        prefix_pieces=prefix_pieces, prefix_segments=tuple(segments), questions=tuple(planned),
        shared_segments=1 if head else 0, return_prompt=return_prompt,
    )
    if max_request_tokens is not None and result.worst_case_tokens > max_request_tokens:
        raise TokenBudgetExceeded(result.worst_case_tokens, max_request_tokens, field=budget_field)
    return result
