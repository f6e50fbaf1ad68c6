"""Every request the guides show reaches an endpoint the stacks create and is answered as the guide says.

What counts as a request, block by block (docs/how-to/*.md, and docs/reference/api.md for JSON bodies):

- A ```json (or ```jsonl) block is read as one JSON value, else as JSON Lines (one value per non-blank line).
  A value is a **request body** when it is an object with a top-level key that `/invocations` dispatches on:
  `decision`, `decisions`, `questions` or `messages` (docs/reference/api.md, "/invocations dispatch rule").
  Answers, labeled rows, limits and calibration files have none of these keys at the top. A block that is
  not valid JSON (an abridged file, `…`) must not contain any of those keys: an abridged request cannot run.
  Each request is POSTed to a local adapter's `/invocations` and must answer 200; a JSON Lines block is also
  POSTed whole as `application/jsonlines`, and no answer line may be an error. A block meant to show a refusal
  says so on the line before its fence: `<!-- status: 422 -->`.
- A ```python block that uses `SemIfClient`, `SageMakerTransport` or `invoke_endpoint` runs as written, with
  boto3's `sagemaker-runtime` client answering `InvokeEndpoint` from the local adapter (botocore's own
  `before-send` hook: the body is serialized, signed and parsed by botocore as for SageMaker; a 4xx comes
  back as SageMaker's `ModelError`). Every endpoint it calls must be a decision endpoint the stacks create, in
  that environment's region, and every call must answer 200. Other Python blocks must compile.
- In ```bash/```sh blocks, `aws sagemaker-runtime invoke-endpoint` names a decision endpoint the stacks create,
  in its region, and its `--body` (an inline JSON argument, or a `fileb://`/`file://` file written by an
  `echo '…' > FILE` or a heredoc in the same guide) answers 200 from the local adapter.
- The calling guide (docs/how-to/call-an-endpoint.md): its IAM policy (a ```json block with a `Statement`) is valid
  IAM, and, evaluated as IAM would, allows `sagemaker:InvokeEndpoint` on the ARN of one decision endpoint the stacks
  create and nothing else; its raw ```http request is the one botocore signs and sends for those parameters, and the
  adapter answers its body 200; its Python example that acts on an answer takes each path it documents (accept,
  fallback, a 503 after the client's backoff, a ModelError 4xx and 5xx) against a stubbed `invoke_endpoint`.
- The calling guide's chat example (a ```python block with `generate_token` and `openai`) runs as written: moto
  answers SSM (`/semif/prod/text/endpoint-name`, `/semif/prod/text/client-role-arn`), IAM and STS; a stand-in
  `sagemaker.core.token_generator` checks that the token is minted from the assumed role's credentials for at most
  12 h; `openai`'s HTTP client is answered locally, on SageMaker's `/endpoints/<chat endpoint>/openai/v1` route with
  that bearer token only, and the snippet prints the answer.
- A ```javascript block that imports `@aws-sdk/client-sagemaker-runtime` runs under Node with a stand-in for that
  module that answers `InvokeEndpointCommand` from the local adapter (a refusal throws `ModelError`, as the SDK does);
  it must call a decision endpoint the stacks create, in its region, and exit 0.
- Everywhere in docs/ (and README.md) and in the operator tools' docstrings, an endpoint or region named in a
  call (`--endpoint`, `--endpoint-name`, `for_endpoint("…")`, `SageMakerTransport("…")`, `EndpointName=…`,
  `--region`, `region_name=…`, `REGION=…`) is one the stacks create. Placeholders (`NAME`, `<endpoint>`,
  `$VAR` that no block sets) are skipped.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import pytest

from serving import ServeProcess, embedded_model, free_port
from test_docs import heredoc_bodies, logical_lines, shell_blocks

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
GUIDES = sorted((DOCS / "how-to").glob("*.md"))
BODY_PAGES = [*GUIDES, DOCS / "reference" / "api.md"]
TOOLS = sorted((REPO / "container" / "semif" / "tools").glob("*.py"))

# The keys by which `/invocations` picks a contract: a JSON object with one of them at the top is a request.
REQUEST_KEYS = ("decision", "decisions", "questions", "messages")
STATUS_MARK = re.compile(r"<!--\s*status:\s*(\d{3})\s*-->")
SDK_MARKERS = ("SemIfClient", "SageMakerTransport", "invoke_endpoint")
JSONLINES = "application/jsonlines"


# ---------------------------------------------------------------- what the stacks create


def stack_endpoints() -> dict[str, dict[str, str]]:
    """{endpoint name: {"env", "region", "kind"}} for every endpoint config/environments.json deploys."""
    config = json.loads((REPO / "config" / "environments.json").read_text())
    endpoints = {}
    for env_name, env in config["environments"].items():
        for kind in ("decision", "text"):
            if env.get(kind):
                endpoints[env[kind]["endpoint_name"]] = {"env": env_name, "region": env["region"], "kind": kind}
    return endpoints


def decision_endpoints() -> dict[str, dict[str, str]]:
    return {name: where for name, where in stack_endpoints().items() if where["kind"] == "decision"}


def stack_regions() -> set[str]:
    return {where["region"] for where in stack_endpoints().values()}


def test_the_stacks_create_a_decision_endpoint_per_environment_named_after_it():
    endpoints = decision_endpoints()
    assert endpoints and all(name == f"semif-{where['env']}-decision" for name, where in endpoints.items()), endpoints


# ---------------------------------------------------------------- extraction


def fenced_blocks(markdown: str, languages: tuple[str, ...]) -> list[tuple[str, str, int]]:
    """(body, the line before the fence with blank lines skipped, line number) of each block in `languages`."""
    blocks = []
    for match in re.finditer(r"(?ms)^([ \t]*)```([\w-]*)[^\n]*\n(.*?)^[ \t]*```", markdown):
        if match.group(2) not in languages:
            continue
        indent = len(match.group(1))
        body = "\n".join(line[indent:] if line[:indent].isspace() else line for line in match.group(3).splitlines())
        before = [line for line in markdown[: match.start()].splitlines() if line.strip()]
        blocks.append((body, before[-1] if before else "", markdown.count("\n", 0, match.start()) + 1))
    return blocks


def parse_json_block(body: str) -> list | None:
    """The block's JSON values (one, or one per line), or None when it is not JSON."""
    try:
        return [json.loads(body)]
    except ValueError:
        pass
    try:
        return [json.loads(line) for line in body.splitlines() if line.strip()]
    except ValueError:
        return None


def is_request(value) -> bool:
    return isinstance(value, dict) and any(key in value for key in REQUEST_KEYS)


def request_blocks(page: Path) -> tuple[list[dict], list[str]]:
    """The page's request bodies ({"where", "values", "status"}), and the abridged blocks that look like requests."""
    requests, abridged = [], []
    for body, before, line in fenced_blocks(page.read_text(), ("json", "jsonl", "jsonlines")):
        where = f"{page.relative_to(REPO)}:{line}"
        values = parse_json_block(body)
        if values is None:
            if re.search(r'"(%s)"\s*:' % "|".join(REQUEST_KEYS), body):
                abridged.append(where)
            continue
        if any(is_request(v) for v in values):
            mark = STATUS_MARK.search(before)
            requests.append({"where": where, "values": values, "status": int(mark.group(1)) if mark else 200})
    return requests, abridged


def all_request_blocks() -> list[dict]:
    return [block for page in BODY_PAGES for block in request_blocks(page)[0]]


def python_blocks(page: Path) -> list[tuple[str, str]]:
    blocks = fenced_blocks(page.read_text(), ("python", "py"))
    return [(f"{page.relative_to(REPO)}:{line}", body) for body, _, line in blocks]


def sdk_snippets() -> list[tuple[str, str]]:
    return [(where, body) for page in GUIDES for where, body in python_blocks(page)
            if any(marker in body for marker in SDK_MARKERS)]


def shell_assignments(guide_text: str) -> dict[str, str]:
    """`VAR=value` and `export A=x B=y` with literal values, across the guide's shell blocks in order."""
    values: dict[str, str] = {}
    for block in shell_blocks(guide_text):
        for line in logical_lines(block):
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            words = words[1:] if words[:1] == ["export"] else words
            for word in words:
                assignment = re.fullmatch(r"([A-Za-z_]\w*)=([^$`]*)", word)
                if not assignment:
                    break
                values[assignment.group(1)] = assignment.group(2)
    return values


def expand(word: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", lambda m: variables.get(m.group(1), m.group(0)), word)


def option_value(words: list[str], option: str) -> str | None:
    for i, word in enumerate(words):
        if word == option and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(option + "="):
            return word.split("=", 1)[1]
    return None


def written_files(guide_text: str) -> dict[str, str]:
    """What the guide's shell blocks write into a file: `echo '…' > FILE`, `printf '…' > FILE`, heredocs."""
    files = {}
    for block in shell_blocks(guide_text):
        for line in logical_lines(block):
            match = re.match(r"\s*(?:echo|printf)\s+('(?:[^']*)'|\"(?:[^\"\\]|\\.)*\")\s*>\s*(\S+)\s*$", line)
            if match:
                files[match.group(2)] = shlex.split(match.group(1))[0]
        for opener, body in heredoc_bodies(block):
            target = re.search(r">\s*(\S+)", opener)
            if target and target.group(1)[0] not in "<&":
                files[target.group(1)] = body
    return files


def invoke_endpoint_commands(guide: Path) -> list[dict]:
    """`aws sagemaker-runtime invoke-endpoint` commands: where, endpoint, region, content type and body."""
    text = guide.read_text()
    variables, files, commands = shell_assignments(text), written_files(text), []
    for block in shell_blocks(text):
        for line in logical_lines(block):
            for command in re.split(r"&&|\|\||;|\|", line):
                try:
                    words = [expand(w, variables) for w in shlex.split(command, comments=True)]
                except ValueError:
                    continue
                if words[:3] != ["aws", "sagemaker-runtime", "invoke-endpoint"]:
                    continue
                body_arg = option_value(words, "--body") or ""
                source = re.match(r"fileb?://(.+)", body_arg)
                commands.append({
                    "id": f"{guide.name}#{len(commands) + 1}",
                    "where": f"{guide.relative_to(REPO)}: {line.strip()[:100]}",
                    "endpoint": option_value(words, "--endpoint-name"),
                    "region": option_value(words, "--region"),
                    "content_type": option_value(words, "--content-type") or "application/json",
                    "body": files.get(source.group(1)) if source else body_arg,
                    "body_source": body_arg,
                })
    return commands


# ---------------------------------------------------------------- the local adapter


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    port = free_port()
    env = {**os.environ, "SEMIF_HOST": "127.0.0.1", "SEMIF_PORT": str(port), "SEMIF_N_THREADS": "2",
           "SEMIF_MODEL_PATH": str(embedded_model())}
    server = ServeProcess(env, port, tmp_path_factory.mktemp("docs-requests") / "serve.log").wait_ready()
    try:
        yield server
    finally:
        server.stop()


def post(adapter, body: bytes, content_type: str = "application/json", headers: dict | None = None) -> httpx.Response:
    return httpx.post(adapter.base_url + "/invocations", content=body, timeout=120,
                      headers={"content-type": content_type, **(headers or {})})


def is_error(answer) -> bool:
    """An error in any contract's shape: SemIf and OpenAI `error`, System One `detail`."""
    return isinstance(answer, dict) and ("error" in answer or "detail" in answer)


# ---------------------------------------------------------------- JSON request bodies


def test_the_guides_show_request_bodies_of_every_contract():
    values = [v for block in all_request_blocks() for v in block["values"] if is_request(v)]
    shapes = {key for v in values for key in REQUEST_KEYS if key in v}
    assert {"decision", "decisions", "questions", "messages"} <= shapes, shapes
    assert len(values) >= 9, len(values)


def test_no_block_shows_an_abridged_request():
    abridged = [where for page in BODY_PAGES for where in request_blocks(page)[1]]
    assert not abridged, f"request bodies that are not valid JSON, so cannot run: {abridged}"


@pytest.mark.parametrize("block", all_request_blocks(), ids=lambda b: b["where"])
def test_every_request_body_in_the_guides_gets_the_status_the_guide_says(adapter, block):
    problems = []
    for value in block["values"]:
        response = post(adapter, json.dumps(value).encode())
        if response.status_code != block["status"]:
            problems.append(f"{response.status_code} (expected {block['status']}) for {json.dumps(value)[:200]}: "
                            f"{response.text[:300]}")
    if len(block["values"]) > 1 and block["status"] == 200:  # JSON Lines, as Batch Transform sends it
        lines = "".join(json.dumps(v) + "\n" for v in block["values"])
        response = post(adapter, lines.encode(), JSONLINES)
        answers = [json.loads(line) for line in response.text.splitlines() if line.strip()]
        if response.status_code != 200 or len(answers) != len(block["values"]) or any(map(is_error, answers)):
            problems.append(f"as JSON Lines: {response.status_code} {response.text[:500]}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the answers api.md shows

API_PAGE = DOCS / "reference" / "api.md"
# What an answer shows that the model decides, whatever ran before it: compared with what the adapter answers.
# Probabilities to 4 decimals (every number under one of these keys), the rest exactly. Cache hits
# (`cached_tokens`, `evaluated_tokens`), ids and timings depend on what ran before, so they are not compared.
PROBABILITY_KEYS = {"probabilities", "probability", "prior", "margin", "confidence", "noul", "label_mass"}
TOKEN_KEYS = {"tokens", "input_tokens", "output_tokens", "total_tokens", "prompt_tokens", "completion_tokens",
              "state_tokens"}
EXACT_KEYS = {"choice", "option_ids", "content", "finish_reason"}


def shown_facts(value, path: tuple = ()) -> dict[tuple, object]:
    """{path: value} of the answer's probabilities (rounded to 4 decimals), choices and token counts."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in shown_facts(item, path + (key,)).items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in shown_facts(item, path + (i,)).items()}
    keys = {key for key in path if isinstance(key, str)}
    if keys & PROBABILITY_KEYS:
        return {path: round(value, 4) if isinstance(value, float) else value}
    if path and path[-1] in TOKEN_KEYS or keys & EXACT_KEYS:
        return {path: value}
    return {}


def answers_request(answer: dict, request: dict) -> bool:
    """Whether ``answer`` is the shape of an answer to ``request`` (same contract; SemIf: same decision id)."""
    if "option_ids" in answer:
        return isinstance(request.get("decision"), dict) and request["decision"].get("id") == answer.get("id")
    if isinstance(answer.get("answers"), dict):  # System One
        return isinstance(request.get("questions"), dict)
    if isinstance(answer.get("answers"), list):  # OpenAI Decisions
        return isinstance(request.get("questions"), list)
    if answer.get("object") == "chat.completion":
        return "messages" in request
    return False


def is_answer(value) -> bool:
    return isinstance(value, dict) and not is_request(value) and (
        "option_ids" in value or "answers" in value or value.get("object") == "chat.completion")


def shown_answers(page: Path = API_PAGE) -> list[dict]:
    """Each JSON answer the page shows, with the request it answers: the nearest request block before it that
    it could answer."""
    pairs, requests = [], []
    for body, _, line in fenced_blocks(page.read_text(), ("json",)):
        values = parse_json_block(body)
        if not values or len(values) != 1:
            continue
        (value,) = values
        if is_request(value):
            requests.append(value)
        elif is_answer(value):
            request = next((r for r in reversed(requests) if answers_request(value, r)), None)
            pairs.append({"where": f"{page.relative_to(REPO)}:{line}", "answer": value, "request": request})
    return pairs


def test_the_api_reference_shows_an_answer_of_every_contract():
    pairs = shown_answers()
    assert all(pair["request"] is not None for pair in pairs), [p["where"] for p in pairs if p["request"] is None]
    shapes = {("decision" if "decision" in p["request"] else "messages" if "messages" in p["request"] else
               type(p["request"]["questions"]).__name__) for p in pairs}
    assert shapes == {"decision", "dict", "list", "messages"}, shapes


@pytest.mark.parametrize("pair", shown_answers(), ids=lambda p: p["where"])
def test_every_answer_the_api_reference_shows_is_the_one_the_adapter_gives(adapter, pair):
    """Probabilities to 4 decimals, choices and token counts, as the embedded model answers the shown request."""
    shown = shown_facts(pair["answer"])
    assert sum(1 for path in shown if set(path) & PROBABILITY_KEYS) >= 1 or "choices" in pair["answer"], shown
    response = post(adapter, json.dumps(pair["request"]).encode())
    assert response.status_code == 200, response.text[:500]
    served = shown_facts(response.json())
    stale = {"/".join(map(str, path)): (value, served.get(path, "absent")) for path, value in shown.items()
             if served.get(path, "absent") != value}
    assert not stale, f"{pair['where']} shows (shown, served): {stale}"


# ---------------------------------------------------------------- Python SDK snippets


class _RawBody(io.BytesIO):
    """What botocore reads an HTTP response body from (`read`, and `stream` for non-streaming bodies)."""

    def stream(self, amt=1024, decode_content=None):
        while chunk := self.read(amt):
            yield chunk


class AdapterBehindSageMaker:
    """Answers every `sagemaker-runtime` InvokeEndpoint request botocore is about to send from the local adapter,
    as SageMaker would: the container's body on 200, otherwise a `ModelError` carrying its status and body.
    Records each call's endpoint, region and status; refuses any other AWS call."""

    def __init__(self, adapter):
        self.adapter = adapter
        self.calls: list[dict] = []
        self.requests: list[dict] = []  # as botocore built them: method, URL, headers, body

    def install(self, monkeypatch) -> None:
        import boto3.session

        real_client = boto3.session.Session.client
        handler = self

        def client(session, *args, **kwargs):
            made = real_client(session, *args, **kwargs)
            made.meta.events.register("before-send", handler.before_send)
            return made

        monkeypatch.setattr(boto3.session.Session, "client", client)

    def before_send(self, request, **_):
        from botocore.awsrequest import AWSResponse

        url = urlsplit(request.url)
        match = re.fullmatch(r"/endpoints/([^/]+)/invocations", url.path)
        if not (url.hostname or "").startswith("runtime.sagemaker.") or not match:
            raise AssertionError(f"the snippet calls {request.method} {request.url}; the test stands in for "
                                 "InvokeEndpoint only")
        body = request.body.read() if hasattr(request.body, "read") else request.body or b""
        body = body.encode() if isinstance(body, str) else body
        self.requests.append({"method": request.method, "url": request.url, "body": body,
                              "headers": {k.lower(): v.decode() if isinstance(v, bytes) else v
                                          for k, v in request.headers.items()}})
        headers = {"content-type": request.headers.get("Content-Type", "application/json")}
        if request.headers.get("X-Amzn-SageMaker-Custom-Attributes"):
            headers["x-amzn-sagemaker-custom-attributes"] = request.headers["X-Amzn-SageMaker-Custom-Attributes"]
        answer = post(self.adapter, body, headers["content-type"], headers)
        region = url.hostname.split(".")[2]
        self.calls.append({"endpoint": unquote(match.group(1)), "region": region, "status": answer.status_code})
        if answer.status_code == 200:
            status, payload = 200, answer.content
            response_headers = {"Content-Type": answer.headers.get("content-type", "application/json"),
                                "x-Amzn-Invoked-Production-Variant": "AllTraffic"}
        else:
            status = 424
            payload = json.dumps({"ErrorCode": "CLIENT_ERROR_FROM_MODEL" if answer.status_code < 500 else
                                  "SERVER_ERROR_FROM_MODEL",
                                  "Message": f"Received error ({answer.status_code}) from primary with message "
                                             f"\"{answer.text}\"",
                                  "OriginalStatusCode": answer.status_code, "OriginalMessage": answer.text}).encode()
            response_headers = {"Content-Type": "application/json", "x-amzn-ErrorType": "ModelError:"}
        response_headers["Content-Length"] = str(len(payload))
        return AWSResponse(request.url, status, response_headers, _RawBody(payload))


@pytest.fixture
def aws_offline(monkeypatch, tmp_path):
    """Credentials that sign but reach nothing; no profile, config file or instance metadata."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def test_the_guides_show_sdk_snippets_and_every_python_block_compiles():
    assert len(sdk_snippets()) >= 1
    for page in GUIDES:
        for where, body in python_blocks(page):
            compile(body, where, "exec")


@pytest.mark.parametrize("snippet", sdk_snippets(), ids=lambda s: s[0])
def test_every_sdk_snippet_runs_against_a_decision_endpoint_the_stacks_create(adapter, aws_offline, monkeypatch,
                                                                              snippet):
    where, code = snippet
    sagemaker = AdapterBehindSageMaker(adapter)
    sagemaker.install(monkeypatch)
    exec(compile(code, where, "exec"), {"__name__": "snippet"})

    endpoints = decision_endpoints()
    assert sagemaker.calls, f"{where} never called InvokeEndpoint"
    for call in sagemaker.calls:
        assert call["endpoint"] in endpoints, f"{where}: {call['endpoint']!r} is not one of {sorted(endpoints)}"
        assert call["region"] == endpoints[call["endpoint"]]["region"], (where, call)
        assert call["status"] == 200, (where, call)
    expected_calls = sum(code.count(call) for call in (".decide(", ".decide_many(", ".system_one(",
                                                       ".decisions.create(", ".invoke_endpoint("))
    assert len(sagemaker.calls) == expected_calls, (where, sagemaker.calls)


def test_the_stand_in_answers_a_refused_request_as_sagemaker_does(adapter, aws_offline, monkeypatch):
    """A 4xx from the container reaches the caller as SageMaker's ModelError would: with its status and body."""
    from semif.tools.client import SemIfClient, SemIfError

    sagemaker = AdapterBehindSageMaker(adapter)
    sagemaker.install(monkeypatch)
    with SemIfClient.for_endpoint("semif-dev-decision", region_name="us-east-1") as client:
        with pytest.raises(SemIfError) as refused:
            client.send({"decision": {"state": "x", "question": "Which?", "options": [{"id": "a"}, {"id": "b"}]}})
    assert refused.value.status == 422 and refused.value.field == "decision.id", refused.value
    assert sagemaker.calls == [{"endpoint": "semif-dev-decision", "region": "us-east-1", "status": 422}]


# ---------------------------------------------------------------- AWS CLI invoke-endpoint commands


def all_invoke_commands() -> list[dict]:
    return [command for guide in GUIDES for command in invoke_endpoint_commands(guide)]


@pytest.mark.parametrize("command", all_invoke_commands(), ids=lambda c: c["id"])
def test_every_invoke_endpoint_command_names_a_stack_endpoint_and_sends_a_valid_body(adapter, command):
    endpoints = decision_endpoints()
    assert command["endpoint"] in endpoints, f"{command['where']}: {command['endpoint']!r} not in {sorted(endpoints)}"
    region = command["region"]
    assert region is None or "$" in region or region == endpoints[command["endpoint"]]["region"], command
    assert command["body"], f"{command['where']}: no guide block writes {command['body_source']!r}"
    response = post(adapter, command["body"].encode(), command["content_type"])
    assert response.status_code == 200, (command["where"], response.status_code, response.text[:500])


# ---------------------------------------------------------------- the calling guide: policy, raw request, JavaScript

CALL_GUIDE = DOCS / "how-to" / "call-an-endpoint.md"


def decision_endpoint_arns() -> dict[str, str]:
    """{decision endpoint name: its ARN}, in its environment's account and region."""
    config = json.loads((REPO / "config" / "environments.json").read_text())["environments"]
    return {name: f"arn:aws:sagemaker:{where['region']}:{config[where['env']]['account']}:endpoint/{name}"
            for name, where in decision_endpoints().items()}


def iam_policies(page: Path) -> list[tuple[str, dict]]:
    """The page's JSON blocks that are IAM policy documents (a `Statement` at the top)."""
    return [(f"{page.relative_to(REPO)}:{line}", json.loads(body))
            for body, _, line in fenced_blocks(page.read_text(), ("json",))
            if parse_json_block(body) and isinstance(json.loads(body), dict) and "Statement" in json.loads(body)]


def test_the_calling_role_policy_allows_invoke_endpoint_on_one_decision_endpoint_and_nothing_else():
    from moto.iam.access_control import IAMPolicy, PermissionResult
    from moto.iam.policy_validation import IAMPolicyDocumentValidator

    (where, policy), = iam_policies(CALL_GUIDE)
    IAMPolicyDocumentValidator(json.dumps(policy)).validate()  # IAM's grammar: raises on a malformed document
    statements = policy["Statement"] if isinstance(policy["Statement"], list) else [policy["Statement"]]
    assert [s["Effect"] for s in statements] == ["Allow"], where
    listed = lambda value: [value] if isinstance(value, str) else list(value)  # noqa: E731
    assert listed(statements[0]["Action"]) == ["sagemaker:InvokeEndpoint"], where
    (resource,) = listed(statements[0]["Resource"])
    arns = decision_endpoint_arns()
    endpoint = resource.rsplit("/", 1)[-1]
    assert arns.get(endpoint) == resource, f"{where}: {resource} is not a decision endpoint's ARN: {sorted(arns.values())}"

    # Evaluated as IAM would: this endpoint only, this action only.
    evaluated = IAMPolicy(json.dumps(policy))
    assert evaluated.is_action_permitted("sagemaker:InvokeEndpoint", resource) == PermissionResult.PERMITTED
    for action, other in [("sagemaker:InvokeEndpoint", arn) for name, arn in arns.items() if name != endpoint] + [
            ("sagemaker:InvokeEndpointWithResponseStream", resource), ("sagemaker:DescribeEndpoint", resource),
            ("sagemaker:InvokeEndpoint", resource.rsplit("/", 1)[0] + "/" + endpoint + "-other")]:
        assert evaluated.is_action_permitted(action, other) != PermissionResult.PERMITTED, (action, other)


def test_the_guide_names_the_stack_output_that_holds_the_endpoint_arn():
    text = CALL_GUIDE.read_text()
    stack = (REPO / "stacks" / "decision_stack.py").read_text()
    assert "/semif/<env>/decision/endpoint-arn" in text and "semif-<env>-decision-endpoint-arn" in text
    assert 'key="decision/endpoint-arn"' in stack  # stacks/outputs.py: SSM /semif/<env>/<key>, export semif-<env>-<key>


def http_requests(page: Path) -> list[dict]:
    """```http blocks: request line, headers and body."""
    requests = []
    for body, _, line in fenced_blocks(page.read_text(), ("http",)):
        head, _, payload = body.partition("\n\n")
        request_line, *header_lines = head.splitlines()
        method, path, _ = request_line.split(" ")
        headers = {name.strip().lower(): value.strip() for name, value in (h.split(":", 1) for h in header_lines)}
        requests.append({"where": f"{page.relative_to(REPO)}:{line}", "method": method, "path": path,
                         "headers": headers, "body": payload.strip().encode()})
    return requests


def test_the_raw_request_is_the_one_botocore_sends_and_the_adapter_answers(adapter, aws_offline, monkeypatch):
    import boto3

    (shown,) = http_requests(CALL_GUIDE)
    endpoint = unquote(re.fullmatch(r"/endpoints/([^/]+)/invocations", shown["path"]).group(1))
    region = shown["headers"]["host"].split(".")[2]
    sagemaker = AdapterBehindSageMaker(adapter)
    sagemaker.install(monkeypatch)
    runtime = boto3.client("sagemaker-runtime", region_name=region)
    answer = runtime.invoke_endpoint(EndpointName=endpoint, Body=shown["body"],
                                     ContentType=shown["headers"]["content-type"], Accept=shown["headers"]["accept"])

    (sent,) = sagemaker.requests
    url = urlsplit(sent["url"])
    assert (sent["method"], url.path, url.hostname) == (shown["method"], shown["path"], shown["headers"]["host"])
    for name in ("content-type", "accept"):
        assert sent["headers"][name] == shown["headers"][name], name
    scope = re.search(r"Credential=[^/]+/\d{8}/([^,]+)", sent["headers"]["authorization"]).group(1)
    assert sent["headers"]["authorization"].startswith("AWS4-HMAC-SHA256 Credential=")
    assert scope in shown["headers"]["authorization"], (scope, shown["headers"]["authorization"])
    assert sent["body"] == shown["body"]
    assert sagemaker.calls == [{"endpoint": endpoint, "region": region, "status": 200}], sagemaker.calls
    assert endpoint in decision_endpoints() and region == decision_endpoints()[endpoint]["region"]
    assert json.loads(answer["Body"].read())["choice"] in ("hardware", "network")


# `@aws-sdk/client-sagemaker-runtime` as the snippets use it: `send(new InvokeEndpointCommand(input))` answers from
# the local adapter, with `Body` as bytes; a refusal throws `ModelError` with `OriginalStatusCode`/`OriginalMessage`.
JS_SDK_STAND_IN = """
import { appendFileSync } from "node:fs";

export class InvokeEndpointCommand {
  constructor(input) { this.input = input; }
}

export class SageMakerRuntimeClient {
  constructor(config = {}) { this.config = config; }

  async send(command) {
    if (!(command instanceof InvokeEndpointCommand)) throw new Error("only InvokeEndpoint stands in");
    const input = command.input;
    const response = await fetch(`${process.env.ADAPTER_URL}/invocations`, {
      method: "POST", headers: { "content-type": input.ContentType }, body: input.Body,
    });
    const text = await response.text();
    appendFileSync(process.env.CALLS_FILE, JSON.stringify({
      endpoint: input.EndpointName, region: this.config.region, status: response.status,
      content_type: input.ContentType, accept: input.Accept ?? null,
    }) + "\\n");
    if (response.status !== 200) {
      const error = new Error(`Received client error (${response.status}) from primary`);
      Object.assign(error, { name: "ModelError", OriginalStatusCode: response.status, OriginalMessage: text });
      throw error;
    }
    return { Body: new TextEncoder().encode(text), ContentType: response.headers.get("content-type") };
  }
}
"""


SAVE_AS = re.compile(r"save it as `([^`/]+)`", re.IGNORECASE)


def javascript_snippets() -> list[tuple[str, str, str | None]]:
    """(where, code, the file name the guide says to save it as: the last "save it as `NAME`" before it)."""
    snippets = []
    for page in GUIDES:
        text = page.read_text()
        for body, _, line in fenced_blocks(text, ("javascript", "js", "mjs")):
            if "@aws-sdk/client-sagemaker-runtime" in body:
                before = "\n".join(text.splitlines()[: line - 1])
                names = SAVE_AS.findall(before.rsplit("```", 1)[-1])  # in the prose since the previous block
                snippets.append((f"{page.relative_to(REPO)}:{line}", body, names[-1] if names else None))
    return snippets


def run_javascript(adapter, tmp_path: Path, code: str, file_name: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """Run a snippet under Node, saved as the guide says, with the stand-in SDK; (the process, the calls it made).
    Nothing around the file says it is an ES module, and Node's guess from the syntax (which not every Node
    the SDK supports makes) is off: the file name alone must make it one, as for a reader on any Node."""
    package = tmp_path / "node_modules" / "@aws-sdk" / "client-sagemaker-runtime"
    package.mkdir(parents=True)
    (package / "package.json").write_text(json.dumps({"name": "@aws-sdk/client-sagemaker-runtime", "type": "module",
                                                      "exports": "./index.js"}))
    (package / "index.js").write_text(JS_SDK_STAND_IN)
    (tmp_path / "package.json").write_text("{}")  # a reader's folder: no "type", so .js is CommonJS
    (tmp_path / file_name).write_text(code)
    calls = tmp_path / "calls.jsonl"
    calls.write_text("")
    node = shutil.which("node")
    assert node, "Node (the CDK CLI's runtime) runs the guides' JavaScript"
    result = subprocess.run([node, "--no-experimental-detect-module", file_name], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                            env={**os.environ, "ADAPTER_URL": adapter.base_url, "CALLS_FILE": str(calls)})
    return result, [json.loads(line) for line in calls.read_text().splitlines()]


def test_the_guide_shows_a_javascript_sdk_snippet():
    assert [where for where, _, _ in javascript_snippets() if where.startswith("docs/how-to/call-an-endpoint.md")]


@pytest.mark.parametrize("snippet", javascript_snippets(), ids=lambda s: s[0])
def test_every_javascript_snippet_runs_against_a_decision_endpoint_the_stacks_create(adapter, tmp_path, snippet):
    where, code, file_name = snippet
    assert file_name, f"{where}: the guide does not say which file to save the snippet as (save it as `NAME`)"
    result, calls = run_javascript(adapter, tmp_path, code, file_name)

    assert result.returncode == 0, (where, result.stderr[-2000:])
    assert calls, f"{where} never called InvokeEndpoint"
    endpoints = decision_endpoints()
    for call in calls:
        assert call["endpoint"] in endpoints and call["region"] == endpoints[call["endpoint"]]["region"], (where, call)
        assert (call["status"], call["content_type"]) == (200, "application/json"), (where, call)
    assert result.stdout.split()[0] in ("hardware", "network"), result.stdout  # it printed the answer's choice


def test_the_javascript_snippet_reads_a_refusal_as_the_containers_status_and_field(adapter, tmp_path):
    """Its `catch` reads ModelError's OriginalStatusCode and the adapter's JSON error (here: no decision id)."""
    (where, code, file_name), = [s for s in javascript_snippets() if s[0].startswith("docs/how-to/call-an-endpoint.md")]
    refused = code.replace('id: "route",', "", 1)
    assert refused != code, "the snippet's decision has no `id` to take out"
    result, calls = run_javascript(adapter, tmp_path, refused, file_name or "snippet.mjs")

    assert result.returncode == 0, (where, result.stderr[-2000:])
    assert [c["status"] for c in calls] == [422]
    assert result.stderr.startswith("422") and "decision.id" in result.stderr, result.stderr


# ---------------------------------------------------------------- the Python example's error paths


def acting_snippet() -> tuple[str, str]:
    (snippet,) = [(where, code) for where, code in sdk_snippets() if "def route(" in code]
    return snippet


def stubbed_client(outcomes: list):
    """A `SemIfClient` on a Stubber'd sagemaker-runtime: each outcome a 200 answer (dict), a ModelError
    `(container status, its JSON error)`, or SageMaker's own error `("sagemaker", code, HTTP status, message)`."""
    import boto3
    from botocore.response import StreamingBody
    from botocore.stub import Stubber

    from semif.tools.client import SemIfClient
    from semif.tools.sagemaker_transport import RetryPolicy, SageMakerTransport

    runtime = boto3.client("sagemaker-runtime", region_name="us-east-1")
    stubber = Stubber(runtime)
    for outcome in outcomes:
        if isinstance(outcome, dict):
            raw = json.dumps(outcome).encode()
            stubber.add_response("invoke_endpoint", {"Body": StreamingBody(io.BytesIO(raw), len(raw)),
                                                     "ContentType": "application/json"})
        elif outcome[0] == "sagemaker":
            _, code, status, message = outcome
            stubber.add_client_error("invoke_endpoint", service_error_code=code, http_status_code=status,
                                     service_message=message)
        else:
            status, error = outcome
            stubber.add_client_error("invoke_endpoint", service_error_code="ModelError", http_status_code=424,
                                     service_message=f"Received error ({status}) from primary",
                                     modeled_fields={"OriginalStatusCode": status,
                                                     "OriginalMessage": json.dumps({"error": error})})
    stubber.activate()
    transport = SageMakerTransport("semif-prod-decision", client=runtime, sleep=lambda seconds: None,
                                   retry=RetryPolicy(max_attempts=3))
    return SemIfClient(transport=transport), stubber


def test_the_python_example_acts_on_action_fallback_503_model_error_and_sagemakers_errors(adapter, aws_offline,
                                                                                         monkeypatch):
    where, code = acting_snippet()
    sagemaker = AdapterBehindSageMaker(adapter)
    sagemaker.install(monkeypatch)
    namespace = {"__name__": "snippet"}
    exec(compile(code, where, "exec"), namespace)  # its own call, through the local adapter
    route = namespace["route"]
    ticket = "The VPN drops every ten minutes when I work from home."
    answer = {"id": "decision", "option_ids": ["hardware", "network"], "probabilities": [0.1, 0.9], "choice": "network"}
    overloaded = {"code": "overloaded", "message": "8 requests are already waiting for the model", "field": None}
    invalid = {"code": "invalid_request", "message": "too long", "field": "decision.state"}
    engine = {"code": "engine_error", "message": "non-finite logits", "field": None}

    # SageMaker's own errors (InvokeEndpoint's error list, and IAM's AccessDeniedException): no ModelError.
    denied = ("sagemaker", "AccessDeniedException", 400, "User: arn:aws:sts::222222222222:assumed-role/app/i-0 is not "
              "authorized to perform: sagemaker:InvokeEndpoint on resource: arn:aws:sagemaker:us-east-1:222222222222:"
              "endpoint/semif-prod-decision because no identity-based policy allows the sagemaker:InvokeEndpoint action")
    unknown = ("sagemaker", "ValidationError", 400, "Endpoint semif-prod-decison of account 222222222222 not found.")
    failed = ("sagemaker", "InternalFailure", 500, "An internal failure occurred.")

    cases = [
        ([{**answer, "action": "accept"}], "network"),  # `fallback` is only in an abstain answer
        ([{**answer, "action": "abstain", "fallback": "triage"}], "triage"),
        ([(503, overloaded)] * 3, "retry-later"),  # every attempt of the client's backoff refused
        ([(503, overloaded), {**answer, "action": "accept"}], "network"),  # the backoff's retry
        ([(500, engine)], "triage"),
        ([failed], "retry-later"),
    ]
    for outcomes, expected in cases:
        client, stubber = stubbed_client(outcomes)
        assert route(client, ticket) == expected, outcomes
        stubber.assert_no_pending_responses()
    client, _ = stubbed_client([(422, invalid)])
    with pytest.raises(ValueError, match="fix the request: decision.state"):
        route(client, ticket)
    for refusal in (denied, unknown):
        client, _ = stubbed_client([refusal])
        with pytest.raises(RuntimeError, match=f"fix the app's AWS setup: {refusal[1]}: ") as caught:
            route(client, ticket)
        assert not isinstance(caught.value, ValueError), "a SageMaker refusal landed in the fix-the-request branch"


# ---------------------------------------------------------------- the chat example: openai client, bearer token


def openai_chat_snippet() -> tuple[str, str]:
    """The calling guide's Python block that mints a bearer token and calls chat completions with `openai`."""
    (snippet,) = [(where, code) for where, code in python_blocks(CALL_GUIDE)
                  if "generate_token" in code and "from openai import" in code]
    return snippet


def test_the_openai_chat_snippet_reads_ssm_assumes_the_client_role_and_sends_its_token_to_the_chat_route(
        aws_offline, monkeypatch, capsys):
    """Runs the guide's snippet as written: moto answers SSM (the text stack's parameters), IAM and STS; a stand-in
    `sagemaker.core.token_generator.generate_token` (sagemaker-core cannot share this venv: rich<15) checks that it
    mints from the assumed role's credentials; `openai`'s HTTP client is answered by an httpx MockTransport that
    checks SageMaker's OpenAI-compatible route, the bearer token and the body."""
    import sys
    import types
    from datetime import timedelta

    import boto3
    import boto3.session
    import openai._base_client as openai_base
    from moto import mock_aws

    where, code = openai_chat_snippet()
    (endpoint, prod_chat), = [(name, w) for name, w in stack_endpoints().items()
                              if (w["env"], w["kind"]) == ("prod", "text")]
    region = prod_chat["region"]
    token = "fake-bearer-token-from-the-stand-in"
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)

    # What STS answered AssumeRole (botocore's own after-call hook, on every client the snippet makes).
    assumed: list[dict] = []
    real_client = boto3.session.Session.client

    def client(session, *args, **kwargs):
        made = real_client(session, *args, **kwargs)
        made.meta.events.register("after-call.sts.AssumeRole", lambda parsed, **_: assumed.append(parsed))
        return made

    monkeypatch.setattr(boto3.session.Session, "client", client)

    # sagemaker.core.token_generator.generate_token: checks what it is given, returns a fake token.
    minted: list[dict] = []

    def generate_token(region=None, aws_credentials_provider=None, expiry=timedelta(hours=12)):
        credentials = aws_credentials_provider.load()
        assert assumed, "generate_token was called before the snippet assumed the client role"
        issued = assumed[-1]["Credentials"]
        assert (credentials.access_key, credentials.secret_key, credentials.token) == (
            issued["AccessKeyId"], issued["SecretAccessKey"], issued["SessionToken"]), \
            "the token is not minted from the assumed role's credentials"
        assert region == prod_chat["region"], region
        assert isinstance(expiry, timedelta) and timedelta(0) < expiry <= timedelta(hours=12), expiry
        minted.append({"region": region, "access_key": credentials.access_key, "expiry": expiry})
        return token

    token_generator = types.ModuleType("sagemaker.core.token_generator")
    token_generator.generate_token = generate_token
    core = types.ModuleType("sagemaker.core")
    core.token_generator = token_generator
    sagemaker = types.ModuleType("sagemaker")
    sagemaker.core = core
    for module in (sagemaker, core, token_generator):
        monkeypatch.setitem(sys.modules, module.__name__, module)

    # openai's default HTTP client, answered locally: a mismatch is a 400 whose message says what differs.
    http = getattr(openai_base, "httpx2", None) or openai_base.httpx  # the httpx module this openai is built on
    expected_url = f"https://runtime.sagemaker.{region}.amazonaws.com/endpoints/{endpoint}/openai/v1/chat/completions"
    sent: list[dict] = []

    def handler(request):
        body = json.loads(request.content or b"null")
        sent.append({"method": request.method, "url": str(request.url),
                     "authorization": request.headers.get("authorization"), "body": body})
        messages = body.get("messages") if isinstance(body, dict) else None
        problems = [f"{what}: {got!r} (expected {want!r})" for what, got, want in [
            ("method", request.method, "POST"), ("url", str(request.url), expected_url),
            ("authorization", request.headers.get("authorization"), f"Bearer {token}")] if got != want]
        if not (isinstance(messages, list) and messages and messages[-1].get("role") == "user"
                and all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                        and isinstance(m.get("content"), str) and m["content"] for m in messages)):
            problems.append(f"messages: {messages!r} (expected chat messages ending with the user's)")
        if problems:
            return http.Response(400, json={"error": {"message": "; ".join(problems), "type": "invalid_request_error"}})
        return http.Response(200, json={
            "id": "chatcmpl-semif", "object": "chat.completion", "created": 1767225600, "model": body.get("model", ""),
            "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                         "message": {"role": "assistant", "content": "hello"}}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}})

    class LocalHttpClient(openai_base.SyncHttpxClientWrapper):
        def __init__(self, **kwargs):
            kwargs["transport"] = http.MockTransport(handler)
            super().__init__(**kwargs)

    monkeypatch.setattr(openai_base, "SyncHttpxClientWrapper", LocalHttpClient)

    with mock_aws():
        iam = boto3.client("iam", region_name=region)
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                         "Principal": {"AWS": "arn:aws:iam::123456789012:root"}}]}
        role_arn = iam.create_role(RoleName="semif-prod-chat-client", AssumeRolePolicyDocument=json.dumps(trust),
                                   MaxSessionDuration=3600)["Role"]["Arn"]
        ssm = boto3.client("ssm", region_name=region)  # the text stack's outputs (stacks/text_stack.py)
        ssm.put_parameter(Name="/semif/prod/text/endpoint-name", Value=endpoint, Type="String")
        ssm.put_parameter(Name="/semif/prod/text/client-role-arn", Value=role_arn, Type="String")
        assumed.clear()
        capsys.readouterr()
        exec(compile(code, where, "exec"), {"__name__": "snippet"})
        printed = capsys.readouterr().out

    assert [a["AssumedRoleUser"]["Arn"].split("/")[1] for a in assumed] == ["semif-prod-chat-client"], assumed
    assert len(minted) == 1 and minted[0]["access_key"] == assumed[0]["Credentials"]["AccessKeyId"], minted
    assert [(s["method"], s["url"], s["authorization"]) for s in sent] == [(
        "POST", expected_url, f"Bearer {token}")], sent
    assert printed.strip() == "hello", printed
    assert token not in printed, "the snippet printed the bearer token"


# ---------------------------------------------------------------- names in every call form


_PLACEHOLDER = re.compile(r"^[A-Z_]+$|[<>…$]")  # NAME, <endpoint>, a variable no block sets
_REGION = re.compile(r"^[a-z]{2}(?:-[a-z]+)+-\d$")
# (the form, whether it must name a decision endpoint): the tools and the SDKs send decisions; the AWS CLI and
# the log groups may name the chat endpoint too.
ENDPOINT_FORMS = ((r"--endpoint[ =]['\"]?([^\s'\"`\\)]+)", True), (r"for_endpoint\(\s*['\"]([^'\"]+)", True),
                  (r"SageMakerTransport\(\s*['\"]([^'\"]+)", True),
                  (r"--endpoint-name[ =]['\"]?([^\s'\"`\\)]+)", False), (r"EndpointName\s*=\s*['\"]([^'\"]+)", False),
                  (r"/aws/sagemaker/Endpoints/([^\s'\"`]+)", False))
REGION_FORMS = (r"--region[ =]['\"]?([^\s'\"`\\)]+)", r"region_name\s*=\s*['\"]([^'\"]+)",
                r"\bREGION=['\"]?([a-z0-9-]+)", r"arn:aws:[a-z-]+:([a-z0-9-]+):\d{12}:")


def tool_docstrings() -> list[tuple[str, str]]:
    return [(str(path.relative_to(REPO)), ast.get_docstring(ast.parse(path.read_text())) or "") for path in TOOLS]


def named_texts() -> list[tuple[str, str]]:
    pages = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [(str(page.relative_to(REPO)), page.read_text()) for page in pages] + tool_docstrings()


def test_every_endpoint_and_region_named_in_a_call_is_one_the_stacks_create():
    endpoints, decisions, regions = stack_endpoints(), decision_endpoints(), stack_regions()
    problems, checked = [], 0
    for where, text in named_texts():
        variables = shell_assignments(text) if where.endswith(".md") else {}
        for number, line in enumerate(text.splitlines(), 1):
            for form, decision_only in ENDPOINT_FORMS:
                for name in re.findall(form, line):
                    name = expand(name, variables)
                    if _PLACEHOLDER.search(name) or name.startswith(("http", "-")):
                        continue
                    checked += 1
                    allowed = decisions if decision_only else endpoints
                    if name not in allowed:
                        problems.append(f"{where}:{number}: endpoint {name!r} is not one of {sorted(allowed)}")
            for form in REGION_FORMS:
                for region in re.findall(form, line):
                    region = expand(region, variables)
                    if not _REGION.match(region):
                        continue
                    checked += 1
                    if region not in regions:
                        problems.append(f"{where}:{number}: region {region!r} is not one of {sorted(regions)}")
    assert checked >= 10, checked
    assert not problems, "\n".join(problems)
