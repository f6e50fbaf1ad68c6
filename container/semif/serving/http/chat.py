"""OpenAI-compatible chat completions (`POST /v1/chat/completions`, and `POST /invocations` with
`messages`) from the decision model's own llama.cpp context, under the same admission control.

Why on the same context: one endpoint, one model in memory, one queue. The price is that a chat
turn overwrites what the context holds, so the decision prefix cache is emptied before and after
every generation (the next decision re-evaluates its state; its answer is unchanged).

Streaming holds the model thread for the whole generation: the worker generates and pushes each
chunk through an asyncio queue that the SSE response drains. Streaming or not, generation stops at
the next token when the client goes away (a waiting request leaves the queue at once) or when
`SEMIF_CHAT_DEADLINE_S` passes; a reply cut by the deadline ends with `finish_reason: "length"`.
See docs/explanation/reliability.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable, Literal, Optional, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..contracts.base import RequestError, first_validation_error
from .headers import request_id_of

NAME = "chat"
log = logging.getLogger("semif.http")

DEFAULT_MAX_TOKENS = 256
MAX_MESSAGES = 256
_MAX_TEXT = 200_000
_END = object()  # the worker is done pushing chunks


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(max_length=_MAX_TEXT)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. `name`, `refusal`: harmless for text chat
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[_TextPart]] = Field(max_length=_MAX_TEXT)

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The subset of the OpenAI request that text generation here honours. Parameters that would
    silently change the meaning (n > 1, tools, logprobs, response_format) are refused, not ignored."""

    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = None
    n: int = Field(default=1, ge=1, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        if isinstance(value, list):
            if len(value) > 4:
                raise ValueError("at most 4 stop sequences")
            if any(not s for s in value):
                raise ValueError("stop sequences must not be empty")
        elif value == "":
            raise ValueError("stop sequence must not be empty")
        return value

    @property
    def token_limit(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def matches(body: Any) -> bool:
    return isinstance(body, dict) and "messages" in body


def parse(body: Any, *, n_ctx: int) -> ChatRequest:
    if not isinstance(body, dict):
        raise RequestError(400, "invalid_request", "the body must be a JSON object", "<body>")
    try:
        request = ChatRequest.model_validate(body)
    except ValidationError as exc:
        error = first_validation_error(exc)
        raise RequestError(400, "invalid_request", error.message, error.field) from None
    if request.token_limit >= n_ctx:
        raise RequestError(400, "invalid_request", f"max_tokens must be below the context size {n_ctx}", "max_tokens")
    return request


def error_body(error: RequestError) -> dict:
    kind = {401: "authentication_error", 404: "not_found_error", 503: "overloaded_error"}.get(
        error.status, "server_error" if error.status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": error.message, "type": kind, "param": error.field, "code": error.code}}


# ---- generation (model thread) -----------------------------------------------------------------

DEADLINE_FINISH_REASON = "length"  # a reply cut short by SEMIF_CHAT_DEADLINE_S, as by max_tokens


class _Stopped(Exception):
    """Generation stopped on a model without an end-of-generation token to force."""


class Stopper:
    """A llama-cpp-python logits processor, called once per token to sample: counts the tokens and,
    once ``cancel`` says stop (client gone, deadline passed), leaves only the model's end-of-generation
    token to sample. llama-cpp-python then ends the completion its usual way, with the text so far and
    its own usage counts, and without one more forward pass. (``create_chat_completion`` takes a
    ``stopping_criteria`` too, but the chat-template handler drops it.) ``reason`` says why it stopped."""

    def __init__(self, cancel: Optional[Callable[[], bool]], eos_token: int):
        self.cancel = cancel
        self.eos_token = eos_token
        self.prompt_tokens = 0
        self.sampled = 0  # tokens sampled so far, a forced end token included
        self.stopped_at: Optional[int] = None  # tokens generated before the stop
        self.reason: Optional[str] = None  # "client_gone" | "deadline"

    def __call__(self, input_ids, scores):
        if self.sampled == 0:  # at the first call the context holds exactly the prompt
            self.prompt_tokens = len(input_ids)
        self.sampled += 1
        if self.reason is None and self.cancel is not None and self.cancel():
            self.reason = "client_gone" if getattr(self.cancel, "gone", False) else "deadline"
            self.stopped_at = self.sampled - 1
        if self.reason is not None:
            if self.eos_token < 0:
                raise _Stopped()
            scores[:] = -np.inf
            scores[self.eos_token] = 0.0
        return scores


def _llama_kwargs(request: ChatRequest) -> dict:
    # OpenAI samples with temperature and top_p only: switch off llama.cpp's extra default filters.
    return dict(
        messages=[{"role": "system" if m.role == "developer" else m.role, "content": m.text} for m in request.messages],
        max_tokens=request.token_limit,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=0,
        min_p=0.0,
        stop=request.stop or [],
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
    )


class _Context:
    """Gives the llama.cpp context to generation and hands it back empty.

    The engine tracks what the context holds (its prefix cache) and llama-cpp-python's `Llama`
    tracks its own `n_tokens`; each side's bookkeeping is wrong once the other has used the
    context, so both are reset on entry and on exit."""

    def __init__(self, engine):
        self.engine = engine

    def __enter__(self):
        self.engine.lock.acquire()
        self.engine.invalidate()
        self.engine.llm.reset()
        return self.engine.llm

    def __exit__(self, *exc):
        try:
            self.engine.invalidate()
            self.engine.llm.reset()
        finally:
            self.engine.lock.release()
        return False


def require_chat_template(engine) -> None:
    """Chat needs the GGUF's own chat template. Without one, llama-cpp-python would format the turns as
    llama-2 (`[INST]`) whatever the model was trained on, and answer plausibly but wrongly: refuse instead."""
    if not engine.info.get("chat_template"):
        raise RequestError(
            501, "chat_unsupported",
            f"the served model ({engine.info.get('file')}) has no chat template (GGUF key tokenizer.chat_template), "
            "so chat completions are not offered; decisions still are. Add the template the model was trained "
            "with to the GGUF (gguf-new-metadata --chat-template-file) or serve a model that has one",
            None,
        )


def _map_llama_error(exc: ValueError) -> RequestError:
    message = str(exc)
    if "exceed context window" in message:
        return RequestError(400, "prompt_too_long", message, "messages")
    return RequestError(400, "invalid_request", message, None)


def generate(engine, request: ChatRequest, stopper: Stopper) -> dict:
    """A whole completion (non-streaming), stopped early by ``stopper``. Runs on the model thread."""
    from llama_cpp import LogitsProcessorList

    with _Context(engine) as llm:
        try:
            completion = llm.create_chat_completion(
                stream=False, logits_processor=LogitsProcessorList([stopper]), **_llama_kwargs(request))
        except _Stopped:
            return {}
        except ValueError as exc:
            raise _map_llama_error(exc) from None
    if stopper.reason == "deadline":
        completion["choices"][0]["finish_reason"] = DEADLINE_FINISH_REASON
    return completion


def generate_stream(engine, request: ChatRequest, push: Callable[[Any], None], stopper: Stopper) -> dict:
    """Push each chunk as it is generated; returns usage. Runs on the model thread."""
    from llama_cpp import LogitsProcessorList

    finish = None
    with _Context(engine) as llm:
        try:
            chunks = llm.create_chat_completion(
                stream=True, logits_processor=LogitsProcessorList([stopper]), **_llama_kwargs(request))
            for chunk in chunks:
                if stopper.reason == "client_gone":
                    break  # nobody reads the rest
                if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                    finish = chunk["choices"][0]["finish_reason"]
                    if stopper.reason == "deadline":
                        chunk["choices"][0]["finish_reason"] = DEADLINE_FINISH_REASON
                push(chunk)
        except _Stopped:
            pass
        except ValueError as exc:
            raise _map_llama_error(exc) from None
    if stopper.stopped_at is not None:
        generated = stopper.stopped_at
    elif finish == "stop":  # the end-of-generation token was sampled but is not part of the completion
        generated = max(stopper.sampled - 1, 0)
    else:
        generated = stopper.sampled
    return {"prompt_tokens": stopper.prompt_tokens, "completion_tokens": generated,
            "total_tokens": stopper.prompt_tokens + generated}


# ---- HTTP ---------------------------------------------------------------------------------------


def _run_fields(task: asyncio.Future) -> dict:
    if task.cancelled() or task.exception() is not None:
        return {}
    usage, admitted = task.result()
    return dict(
        queue_ms=round(admitted.queue_ms, 3), compute_ms=round(admitted.compute_ms, 3),
        tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
    )


def _reproducibility(info: dict, image_digest: Optional[str]) -> str:
    """OpenAI's `system_fingerprint`, carrying the model sha, llama.cpp build and template version."""
    parts = [f"sha256:{info['sha256'][:16]}", f"llama.cpp:{info['llama_cpp_build']}", info["template_version"]]
    if image_digest:
        parts.append(image_digest)
    return " ".join(parts)


async def handle(service, request, body: Any = None) -> Any:
    """Answer one chat completion; ``service`` is the app's DecisionService (settings, engine, admission)."""
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse, Response, StreamingResponse

    from .admission import Abandoned, Cancellation, Overloaded
    from .disconnect import watching

    started = time.perf_counter()
    request_id = request_id_of(request.headers)
    headers = {"x-request-id": request_id}
    fields: dict[str, Any] = {"request_id": request_id, "route": request.url.path, "contract": NAME}
    engine = service.engine
    streaming = False

    def finish(status: int, **extra) -> None:
        fields.update(status=status, **extra)
        fields["total_ms"] = round((time.perf_counter() - started) * 1000, 3)
        fields["model_sha256"] = engine.info["sha256"]
        fields["template_version"] = engine.info["template_version"]
        fields["image_digest"] = service.settings.image_digest
        log.info("request", extra=fields)

    def error_response(error: RequestError, extra_headers: Optional[dict] = None) -> Response:
        finish(error.status, error_code=error.code, error_field=error.field)
        return JSONResponse(error_body(error), status_code=error.status, headers={**headers, **(extra_headers or {})})

    try:
        require_chat_template(engine)  # before the body is read: nothing to queue for
        if body is None:
            body = await service.read_body(request)
        chat = parse(body, n_ctx=engine.n_ctx)
        fields.update(messages=len(chat.messages), max_tokens=chat.token_limit, stream=chat.stream)
        completion_id = "chatcmpl-" + request_id[:32]
        created = int(time.time())
        fingerprint = _reproducibility(engine.info, service.settings.image_digest)
        model_name = service.settings.served_model_name

        def restamp(payload: dict) -> dict:
            payload.update(id=completion_id, created=created, model=model_name, system_fingerprint=fingerprint)
            return payload

        # Counted from arrival, queue wait included, like SEMIF_REQUEST_DEADLINE_S for decisions.
        cancel = Cancellation(time.monotonic() + service.settings.chat_deadline_s - (time.perf_counter() - started))
        stopper = Stopper(cancel, engine.llm.token_eos())
        fields["deadline_s"] = service.settings.chat_deadline_s
        if not chat.stream:
            async with watching(request, cancel):
                completion, admitted = await service.admission.run(lambda: generate(engine, chat, stopper), cancel)
            usage = completion.get("usage") or {}
            run_fields = dict(queue_ms=round(admitted.queue_ms, 3), compute_ms=round(admitted.compute_ms, 3),
                              tokens=usage.get("prompt_tokens", stopper.prompt_tokens),
                              completion_tokens=usage.get("completion_tokens", stopper.stopped_at))
            if cancel.gone:
                finish(499, error_code="client_disconnected", stopped="client_gone", **run_fields)
                return Response(status_code=499)
            if not completion:  # stopped at the deadline on a model without an end token to force
                raise RequestError(504, "deadline_exceeded", f"the reply did not finish within "
                                   f"{service.settings.chat_deadline_s:g} s (SEMIF_CHAT_DEADLINE_S)", None)
            restamp(completion)
            finish(200, finish_reason=completion["choices"][0].get("finish_reason"), stopped=stopper.reason,
                   **run_fields)
            return JSONResponse(completion, headers=headers)

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def push(item: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        def work() -> dict:
            try:
                return generate_stream(engine, chat, push, stopper)
            finally:
                push(_END)

        # The status line waits for the first chunk, so that refusals (503) and errors found before
        # any token (a prompt longer than the context) still get their own status code. Until then
        # the client is watched here (a waiting request leaves the queue when it goes); once the
        # response streams, Starlette notices the disconnect and the events generator below stops.
        async with watching(request, cancel):
            run = asyncio.ensure_future(service.admission.run(work, cancel))
            run.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved below or logged there
            first = asyncio.ensure_future(queue.get())
            try:
                await asyncio.wait({run, first}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                cancel.leave()
                raise
            if not first.done():
                first.cancel()
                await run  # not admitted: raises Overloaded or Abandoned before any byte was sent
            if first.result() is _END:
                await run  # failed before the first token: raises the error
            if cancel.gone:  # left between the first token and here: nobody to stream to
                await asyncio.wait([run])
                finish(499, error_code="client_disconnected", stopped="client_gone", **_run_fields(run))
                return Response(status_code=499)
        streaming = True

        async def events():
            status, extra = 200, {}
            try:
                item = first.result()
                while item is not _END:
                    yield "data: " + json.dumps(restamp(item), ensure_ascii=False) + "\n\n"
                    item = await queue.get()
                try:
                    usage, _ = await run
                except RequestError as error:
                    status, extra = error.status, {"error_code": error.code}
                    yield "data: " + json.dumps(error_body(error)) + "\n\n"
                    return
                except Exception as error:  # the response has started: report in-band, log the cause
                    status, extra = 500, {"error_code": "internal_error"}
                    log.error("chat generation failed", extra={"request_id": request_id, "error_type": type(error).__name__, "error": str(error)})
                    yield "data: " + json.dumps(error_body(RequestError(500, "internal_error", "internal error; see the server log"))) + "\n\n"
                    return
                if chat.include_usage:
                    tail = {"object": "chat.completion.chunk", "choices": [], "usage": usage}
                    yield "data: " + json.dumps(restamp(tail)) + "\n\n"
                yield "data: [DONE]\n\n"
            except (asyncio.CancelledError, GeneratorExit):
                status, extra = 499, {"error_code": "client_disconnected"}
                raise
            finally:
                cancel.leave()  # a client that went away stops generation at the next token
                # The log line waits for the model thread, so it tells how long the model was held.
                run.add_done_callback(lambda task: finish(status, **extra, stopped=stopper.reason, **_run_fields(task)))

        return StreamingResponse(
            events(), media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache", "x-accel-buffering": "no"},
        )
    except RequestError as error:
        if error.status == 503:  # the body budget (semif/serving/http/body.py): retryable, like a full queue
            return error_response(error, {"retry-after": str(service.settings.retry_after_s)})
        return error_response(error, {"connection": "close"} if error.status == 408 else None)
    except Overloaded as error:
        retry = {"retry-after": str(service.settings.retry_after_s)}
        fields.update(reason=error.reason, waiting=service.admission.waiting)
        return error_response(RequestError(503, "overloaded", str(error), None), retry)
    except Abandoned as error:
        if error.reason == "client_gone":
            finish(499, error_code="client_disconnected", stopped="client_gone", completion_tokens=0)
            return Response(status_code=499)
        return error_response(RequestError(
            504, "deadline_exceeded", f"the request waited for the model until its deadline of "
            f"{service.settings.chat_deadline_s:g} s (SEMIF_CHAT_DEADLINE_S) passed; retry later", None))
    except ClientDisconnect:
        finish(499, error_code="client_disconnected")
        return Response(status_code=499)
    except Exception as error:  # never a stack trace to the client; the log keeps it
        if streaming:
            raise
        log.exception("unhandled error", extra={"request_id": request_id, "error_type": type(error).__name__})
        return error_response(RequestError(500, "internal_error", "internal error; see the server log", None))
