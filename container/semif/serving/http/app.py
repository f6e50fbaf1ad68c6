"""HTTP: Starlette routes, admission control, request ids and one JSON log line per request.
Knows nothing of llama.cpp; talks to the engine through contracts."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.middleware import Middleware
from starlette.routing import Route

from . import chat, jsonlines
from .admission import Abandoned, Admission, Cancellation, Overloaded
from .auth import BearerAuth
from .disconnect import watching
from .headers import SAGEMAKER_ATTRIBUTES, custom_attribute, request_id_of
from .responses import check_size, json_answer, json_bytes
from .body import MAX_JSON_DEPTH, BodyBudget, BodyBudgetExceeded, read_json  # noqa: F401 (MAX_JSON_DEPTH: re-exported)
from ..config import Settings
from ..contracts import semif as semif_contract
from ..contracts import openai_decisions, systemone
from ..contracts.base import Job, Limits, RequestError, RunContext, excerpt, resolve_layout
from ..engine.context import Cancelled, EngineError, LabelError, PlanError, PromptTooLong, TokenBudgetExceeded
from ..logs import state_digest_fields
from ..postprocess.policy import log_fields as policy_log_fields, min_label_mass, needs_injection_check
from ..postprocess.postprocessor import DecisionPostprocessor

log = logging.getLogger("semif.http")

BODY_TIMEOUT_S = 30.0


class DecisionService:
    """Glue between HTTP, admission control and the engine; one per process."""

    def __init__(self, settings: Settings, engine, contracts: Optional[list] = None):
        self.settings = settings
        self.engine = engine
        self.admission = Admission(max_queue=settings.max_queue, queue_timeout_s=settings.queue_timeout_s)
        self.limits = Limits(max_options=settings.max_options, max_questions=settings.max_questions,
                             max_state_chars=settings.max_state_chars)
        # Bytes of bodies being read or parsed at once (SEMIF_BODY_BUDGET_BYTES): bounds the memory that
        # requests take before admission, whatever the queue limit.
        self.body_budget = BodyBudget(settings.body_budget_bytes)
        self.contracts = contracts if contracts is not None else [semif_contract, systemone, openai_decisions]
        self.postprocessors: list[Callable[[Job, Any], None]] = []
        # Calibration (SEMIF_CALIBRATION_PATH, configured by __main__) and abstention policy.
        self.decision_postprocessor = DecisionPostprocessor()
        self.postprocessors.append(self.decision_postprocessor)
        # A body that has not fully arrived by then gets 408 (slow-loris clients hold no slot forever).
        self.body_timeout_s = BODY_TIMEOUT_S
        # SEMIF_BATCHING: waiting decision requests are decoded together (batching.py), under the same
        # admission limits. Off (the default), every request runs alone: answers never depend on traffic.
        self.batcher = None
        if settings.batching and getattr(engine, "n_seq", 1) > 1:
            from .batch_collector import BatchCollector

            self.batcher = BatchCollector(self.admission, engine, n_seq=engine.n_seq)

    async def run_plan(self, plan, cancel: Cancellation):
        """Execute a finished plan under admission control: alone (default) or batched with other waiting
        requests. ``cancel`` ends the wait in the queue and stops the plan between two questions."""
        if self.batcher is not None:
            return await self.batcher.run(plan, cancel)
        engine = self.engine
        return await self.admission.run(lambda: engine.execute(plan, cancel=cancel), cancel)

    def prompt_options(self, job: Job) -> dict:
        """Layout and injection check for one request: what it asked, else the server's defaults
        (SEMIF_LAYOUT, SEMIF_INJECTION_CHECK); a policy with max_injection always runs the check."""
        check = job.injection_check if job.injection_check is not None else self.settings.injection_check
        # What a 413 names when the checks push the request over the token budget: what turned them on.
        check_field = "injection_check" if job.injection_check else job.budget_field
        if needs_injection_check(getattr(job, "policy", None), self.decision_postprocessor.default_policy):
            check = True
            if not job.injection_check and needs_injection_check(getattr(job, "policy", None)):
                check_field = "policy.max_injection"  # the request's own policy asked for it
        return {"layout": resolve_layout(job, self.settings.layout), "injection_check": check,
                "layout_field": job.layout_field, "second_look": job.second_look,
                "second_look_field": job.second_look_field, "injection_check_field": check_field,
                "reads": job.reads}

    async def read_body(self, request: Request) -> Any:
        """The parsed JSON body, read once per request: /invocations peeks at it to pick chat or decisions
        before the handler runs, and the handler gets the same body (or the same error) again."""
        if "semif.body" not in request.scope:
            try:
                body = await asyncio.wait_for(
                    read_json(request, self.settings.max_body_bytes, budget=self.body_budget,
                              max_values=self.settings.max_json_values), self.body_timeout_s)
                request.scope["semif.body"] = (body, None)
            except asyncio.TimeoutError:
                error = RequestError(408, "body_timeout", f"the body did not arrive within {self.body_timeout_s:g} s", "<body>")
                request.scope["semif.body"] = (None, error)
            except (RequestError, ClientDisconnect) as error:
                request.scope["semif.body"] = (None, error)
        body, error = request.scope["semif.body"]
        if error is not None:
            raise error
        return body

    def contract_for(self, body: Any, override: Optional[str]):
        if override:
            for contract in self.contracts:
                if contract.NAME == override:
                    return contract
            names = ", ".join(c.NAME for c in self.contracts)
            raise RequestError(400, "unknown_contract", f"contract={excerpt(override)!r}; known: {names}", SAGEMAKER_ATTRIBUTES)
        for contract in self.contracts:
            if contract.matches(body):
                return contract
        return None

    async def handle(self, request: Request, contract=None) -> Response:
        started = time.perf_counter()
        request_id = request_id_of(request.headers)
        fields: dict[str, Any] = {"request_id": request_id, "route": request.url.path}
        job: Optional[Job] = None
        headers = {"x-request-id": request_id}
        active = contract or semif_contract
        try:
            body = await self.read_body(request)
            if contract is None:
                override = custom_attribute(request.headers.get(SAGEMAKER_ATTRIBUTES, ""), "contract")
                contract = self.contract_for(body, override)
                if contract is None:
                    raise RequestError(
                        422, "unknown_body_shape",
                        "cannot tell the contract from the body: send 'decision'/'decisions' (SemIf), "
                        "'questions' with 'state' (System One) or with 'input' (OpenAI Decisions)",
                        "<body>",
                    )
                active = contract
            # Off the event loop: rendering an object state as JSON text is linear but not instant.
            job = await asyncio.to_thread(contract.parse, body, self.limits)
            _check_model_name(contract, body, self.settings)
            fields.update(state_digest_fields(job.state_text, self.settings.log_hash_key))
            fields["options_sha256"] = job.options_sha256
            engine = self.engine
            # Everything that does not need the context happens here, off the model thread: fencing,
            # tokenization, length and budget checks. Only a finished plan waits for admission.
            plan = await asyncio.to_thread(
                engine.plan, job.state_text, job.questions, scoring=job.scoring, return_prompt=job.return_prompt,
                state_field=job.state_field, question_fields=job.question_fields, question_names=job.question_names,
                budget_field=job.budget_field, max_request_tokens=self.settings.max_request_tokens,
                **self.prompt_options(job),
                debias=job.debias, default_debias=self.settings.debias,
            )
            fields.update(layout=plan.layout, plan_template_version=plan.template_version)
            cancel = Cancellation(time.monotonic() + self.settings.request_deadline_s - (time.perf_counter() - started))
            try:
                async with watching(request, cancel):
                    result, admitted = await self.run_plan(plan, cancel)
            except Abandoned as stopped:
                fields["questions_done"] = 0
                if stopped.reason == "client_gone":
                    raise ClientDisconnect() from None
                raise RequestError(
                    504, "deadline_exceeded",
                    f"the request waited for the model until its deadline of {self.settings.request_deadline_s:g} s "
                    "(SEMIF_REQUEST_DEADLINE_S) passed; retry later or on another instance", None,
                ) from None
            except Cancelled as stopped:
                fields["questions_done"] = stopped.done
                if cancel.gone:
                    raise ClientDisconnect() from None
                raise RequestError(
                    504, "deadline_exceeded",
                    f"the request did not finish within {self.settings.request_deadline_s:g} s "
                    f"(SEMIF_REQUEST_DEADLINE_S; {stopped}); retry with fewer questions", None,
                ) from None
            for post in self.postprocessors:
                post(job, result)
            total_ms = (time.perf_counter() - started) * 1000
            run = RunContext(
                request_id=request_id,
                model=engine.info,
                served_model_name=self.settings.served_model_name,
                queue_ms=admitted.queue_ms,
                compute_ms=admitted.compute_ms,
                total_ms=total_ms,
                image_digest=self.settings.image_digest,
            )
            # Off the event loop: a batch's render de-duplicates prompts that each hold the state.
            payload = await asyncio.to_thread(job.render, result, run)
            fields.update(
                status=200, queue_ms=round(admitted.queue_ms, 3), compute_ms=round(admitted.compute_ms, 3),
                tokens=result.input_tokens, cached_tokens=result.cached_tokens, evaluated_tokens=result.evaluated_tokens,
                questions=len(job.questions), scoring=result.distributions[0].scoring if result.distributions else None,
                margin=_min_margin(result), label_mass=min_label_mass(result), debias=plan.debias,
            )
            if self.batcher is not None:
                fields["batch_requests"] = getattr(result, "batch_requests", 1)
            fields.update(policy_log_fields(result))
            if result.injection_suspected is not None:
                fields["injection_suspected"] = round(result.injection_suspected, 6)
            response = await json_answer(payload, headers=headers, max_bytes=self.settings.max_response_bytes,
                                         field="return_prompt" if job.return_prompt else job.budget_field)
            fields["response_bytes"] = len(response.body)
            return response
        except RequestError as error:
            fields.update(status=error.status, error_code=error.code, error_field=error.field)
            if isinstance(error, BodyBudgetExceeded):
                headers["retry-after"] = str(self.settings.retry_after_s)
                fields["body_budget_in_use"] = self.body_budget.in_use
            return JSONResponse(active.error_body(error), status_code=_error_status(active, error), headers=headers)
        except PromptTooLong as error:
            req_error = RequestError(413, error.code, str(error), error.field or "state", {"tokens": error.tokens, "n_ctx": error.n_ctx})
            fields.update(status=413, error_code=error.code, error_field=req_error.field, tokens=error.tokens)
            return JSONResponse(active.error_body(req_error), status_code=413, headers=headers)
        except TokenBudgetExceeded as error:
            req_error = RequestError(413, error.code, str(error), error.field, {"tokens": error.tokens, "budget": error.budget})
            fields.update(status=413, error_code=error.code, error_field=req_error.field, tokens=error.tokens)
            return JSONResponse(active.error_body(req_error), status_code=413, headers=headers)
        except LabelError as error:
            req_error = RequestError(422, error.code, str(error), error.field or "options")
            fields.update(status=422, error_code=error.code, error_field=req_error.field)
            return JSONResponse(active.error_body(req_error), status_code=_error_status(active, req_error), headers=headers)
        except PlanError as error:  # a request the plan cannot serve as asked (debias, layout, …): the client's to change
            req_error = RequestError(422, error.code, str(error), error.field)
            fields.update(status=422, error_code=error.code, error_field=req_error.field)
            return JSONResponse(active.error_body(req_error), status_code=_error_status(active, req_error), headers=headers)
        except Overloaded as error:
            headers["retry-after"] = str(self.settings.retry_after_s)
            req_error = RequestError(503, "overloaded", str(error), None)
            fields.update(status=503, error_code="overloaded", reason=error.reason, waiting=self.admission.waiting)
            return JSONResponse(active.error_body(req_error), status_code=503, headers=headers)
        except ClientDisconnect:
            fields.update(status=499, error_code="client_disconnected")
            return Response(status_code=499)
        except EngineError as error:
            fields.update(status=500, error_code=error.code)
            log.error("engine error", extra={"request_id": request_id, "error": str(error)})
            return JSONResponse(
                active.error_body(RequestError(500, error.code, str(error), None)), status_code=500, headers=headers
            )
        except Exception as error:  # never a stack trace to the client; the log keeps it (without state)
            fields.update(status=500, error_code="internal_error")
            log.exception("unhandled error", extra={"request_id": request_id, "error_type": type(error).__name__})
            return JSONResponse(
                active.error_body(RequestError(500, "internal_error", "internal error; see the server log", None)),
                status_code=500, headers=headers,
            )
        finally:
            fields["total_ms"] = round((time.perf_counter() - started) * 1000, 3)
            fields["contract"] = getattr(active, "NAME", None)
            fields["model_sha256"] = self.engine.info["sha256"]
            fields["template_version"] = self.engine.info["template_version"]
            fields["image_digest"] = self.settings.image_digest
            log.info("request", extra=fields)

    async def answer_record(self, body: Any, contract, *, request_id: str, cancel: Cancellation,
                            limits: "jsonlines.RouteLimits") -> tuple[int, "bytes | dict", dict]:
        """One record of a JSON Lines mini-batch (semif/serving/http/jsonlines.py), on the same path as a JSON request:
        parse, plan off the model thread (fencing, tokens, length and budget checks), admission, execute with
        ``cancel`` checked between questions, render. Returns (status, the answer as JSON bytes or the contract's
        error body, log fields). Overloaded propagates: the mini-batch as a whole is refused so that Batch Transform retries it;
        so does ClientDisconnect, when the mini-batch's client went away (nobody reads the answer)."""
        fields: dict[str, Any] = {}
        try:
            job = await asyncio.to_thread(contract.parse, body, self.limits)
            _check_model_name(contract, body, self.settings)
            engine = self.engine
            try:
                plan = await asyncio.to_thread(
                    engine.plan, job.state_text, job.questions, scoring=job.scoring, return_prompt=job.return_prompt,
                    state_field=job.state_field, question_fields=job.question_fields,
                    question_names=job.question_names, budget_field=job.budget_field,
                    max_request_tokens=limits.max_request_tokens, **self.prompt_options(job),
                    debias=job.debias, default_debias=self.settings.debias,
                )
            except TokenBudgetExceeded as over:
                raise RequestError(413, over.code, f"the record may evaluate up to {over.tokens} tokens; a record "
                                   f"may use {over.budget} ({limits.budget_setting})", over.field,
                                   {"tokens": over.tokens, "budget": over.budget}) from None
            try:
                result, admitted = await self.run_plan(plan, cancel)
            except (Abandoned, Cancelled) as stopped:
                fields["questions_done"] = getattr(stopped, "done", 0)
                if cancel.gone:
                    raise ClientDisconnect() from None
                raise RequestError(
                    504, "deadline_exceeded",
                    f"the record did not finish within the mini-batch deadline of {limits.deadline_s:g} s "
                    f"({limits.deadline_setting}; {stopped}); resubmit it", None,
                ) from None
            for post in self.postprocessors:
                post(job, result)
            run = RunContext(request_id=request_id, model=engine.info, served_model_name=self.settings.served_model_name,
                             queue_ms=admitted.queue_ms, compute_ms=admitted.compute_ms,
                             total_ms=admitted.queue_ms + admitted.compute_ms, image_digest=self.settings.image_digest)
            fields.update(tokens=result.input_tokens, cached_tokens=result.cached_tokens,
                          evaluated_tokens=result.evaluated_tokens)
            # Rendered and serialised off the event loop, within the cap a JSON answer has: a record over it gets
            # its own 413 line, and the other records are still answered.
            answer = await asyncio.to_thread(lambda: json_bytes(job.render(result, run)))
            field = "return_prompt" if job.return_prompt else job.budget_field
            return 200, check_size(answer, max_bytes=self.settings.max_response_bytes, field=field,
                                   what="the record's answer"), fields
        except (RequestError, EngineError) as exc:
            error = jsonlines.as_request_error(exc)
        except (Overloaded, ClientDisconnect):
            raise
        except Exception as exc:  # never a stack trace in the output; the log keeps it (without state)
            log.exception("unhandled error", extra={"request_id": request_id, "error_type": type(exc).__name__})
            error = jsonlines.as_request_error(exc)
        fields["error_code"] = error.code
        return _error_status(contract, error), contract.error_body(error), fields


def _check_model_name(contract, body: Any, settings: Settings) -> None:
    """Contracts with a `model` field (System One, OpenAI) declare MODEL_ALIASES, their SDKs' default names;
    those and the served model's own name are answered, any other name is a 404."""
    aliases = getattr(contract, "MODEL_ALIASES", None)
    requested = body.get("model", aliases[0]) if aliases and isinstance(body, dict) else None
    if requested is None:
        return
    served = settings.served_model_name
    if requested not in (*aliases, served, settings.model_path.name):
        raise RequestError(404, "model_not_found", f"model {excerpt(requested)!r} is not served here; use {served!r} "
                           f"or {' or '.join(repr(a) for a in aliases)}", "model")


def _error_status(contract, error: RequestError) -> int:
    """A contract may map a status onto its API's convention (System One: bad JSON is 422; OpenAI: 400)."""
    hook = getattr(contract, "error_status", None)
    return hook(error) if hook else error.status


def models_listing(settings: Settings, engine) -> dict:
    """`GET /v1/models` in both the OpenAI (`data`) and the System One (`models`) shapes."""
    import datetime

    name = settings.served_model_name
    path = getattr(engine, "model_path", None)
    created = int(path.stat().st_mtime) if path is not None and path.exists() else 0
    released = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).strftime("%Y-%m-%d")
    description = (f"{engine.info['file']} (sha256 {engine.info['sha256'][:12]}…) served by the SemIf adapter; "
                   "answers System One (model alias jev-latest) and OpenAI Decisions requests")
    return {
        "object": "list",
        "data": [{"id": name, "object": "model", "created": created, "owned_by": "semif",
                  "output_modalities": ["decisions"]}],
        "models": [{"name": name, "description": description, "release_date": released,
                    "output_modalities": ["decisions"]}],
    }


def _min_margin(result) -> Optional[float]:
    margins = []
    for dist in result.distributions:
        ranked = sorted(dist.probabilities, reverse=True)
        if len(ranked) > 1:
            margins.append(ranked[0] - ranked[1])
    return round(min(margins), 6) if margins else None


def create_app(settings: Settings, engine, *, extra_routes: Optional[list] = None, contracts: Optional[list] = None) -> Starlette:
    service = DecisionService(settings, engine, contracts=contracts)

    async def ping(request: Request) -> Response:
        # Never waits for the model: answers from the event loop while a decision computes.
        if service.engine is None or service.admission.draining:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return JSONResponse({"status": "ok", "model": service.engine.info["file"], "sha256": service.engine.info["sha256"]})

    async def invocations(request: Request) -> Response:
        if jsonlines.is_json_lines(request.headers.get("content-type")):
            return await jsonlines.handle(service, request)
        try:
            body = await service.read_body(request)
        except Exception:  # the handler reads the same error back and answers it
            body = None
        if chat.matches(body):
            return await chat.handle(service, request, body)
        return await service.handle(request)

    async def chat_route(request: Request) -> Response:
        return await chat.handle(service, request)

    async def semif_route(request: Request) -> Response:
        return await service.handle(request, semif_contract)

    async def systemone_route(request: Request) -> Response:
        return await service.handle(request, systemone)

    async def decisions_route(request: Request) -> Response:
        return await service.handle(request, openai_decisions)

    async def models_route(request: Request) -> Response:
        return JSONResponse(models_listing(settings, service.engine))

    async def execution_parameters(request: Request) -> Response:
        return JSONResponse(jsonlines.execution_parameters(settings))

    routes = [
        Route("/ping", ping, methods=["GET"]),
        Route("/invocations", invocations, methods=["POST"]),
        Route("/execution-parameters", execution_parameters, methods=["GET"]),
        Route("/v1/semif", semif_route, methods=["POST"]),
        Route("/v1/systemone", systemone_route, methods=["POST"]),
        Route("/v1/decisions", decisions_route, methods=["POST"]),
        Route("/v1/models", models_route, methods=["GET"]),
        Route("/v1/chat/completions", chat_route, methods=["POST"]),
    ]
    routes += extra_routes or []

    async def not_found(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 404)
        code = "method_not_allowed" if status == 405 else "not_found"
        return JSONResponse({"error": {"code": code, "message": f"{request.method} {request.url.path}", "field": None}}, status_code=status)

    # SEMIF_API_KEY: every route but /ping needs `Authorization: Bearer <key>`; unset, the header is ignored.
    middleware = [Middleware(BearerAuth, api_key=settings.api_key)] if settings.api_key else []
    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found}, middleware=middleware)
    app.state.service = service
    return app
