"""The commands the pipeline's CodeBuild steps run, as plain shell: tests run them with stand-ins for ``aws``.

Each step reads its inputs from environment variables the pipeline stack sets (named in each function).
"""

from __future__ import annotations

import json

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
TARGET_PROFILE = "semif-target"

# A request every SemIf build must answer; the smoke step checks the answer's shape, not just the status.
SMOKE_REQUEST = {"decision": {
    "id": "smoke",
    "state": "Customer writes: I was charged twice for my subscription this month.",
    "question": "Which team should handle this ticket?",
    "options": [{"id": "billing"}, {"id": "technical"}, {"id": "sales"}],
}}
SMOKE_CHAT_REQUEST = {"messages": [{"role": "user", "content": "Reply with the single word: ready"}],
                      "max_tokens": 8, "temperature": 0}
# Checks the decision answer: a choice among the options and probabilities that sum to 1, from the image this stage
# deployed (``image.json``, the image step's output): an endpoint whose blue/green update rolled back is InService on
# the old configuration, and its answers name the old digest.
CHECK_DECISION = (
    "import json,sys; r=json.load(open('response.json')); ids=r['option_ids']; p=r['probabilities']; "
    "assert ids==['billing','technical','sales'], ids; assert r['choice'] in ids, r['choice']; "
    "assert len(p)==3 and abs(sum(p)-1)<1e-3, p; "
    "want=json.load(open('image.json'))['imageDigest']; got=(r.get('model') or {}).get('image_digest'); "
    "assert got==want, 'the endpoint answers from image %s, not %s that this stage deployed: the update did not "
    "take (a blue/green rollback keeps the old configuration InService)' % (got, want); "
    "print('decision ok:', r['choice'], p, 'from', got)"
)
CHECK_CHAT = (
    "import json; r=json.load(open('chat.json')); text=r['choices'][0]['message']['content']; "
    "assert isinstance(text,str) and text.strip(), r; print('chat ok:', text[:80])"
)


def assume_role(role_arn_variable: str) -> list[str]:
    """Act as the role in ``$<role_arn_variable>`` from here on, through an AWS config profile sourcing the step's own
    (CodeBuild container) credentials: the CLI and boto3 assume the role again whenever its credentials expire.

    Exported keys would not last: role chaining caps each session at one hour, and a bake may run for eight.
    """
    return [
        'export AWS_CONFIG_FILE="$PWD/.semif-aws-config"',
        f"printf '[profile {TARGET_PROFILE}]\\nrole_arn = %s\\ncredential_source = EcsContainer\\n"
        f"role_session_name = semif-pipeline\\n' \"${role_arn_variable}\" > \"$AWS_CONFIG_FILE\"",
        f"export AWS_PROFILE={TARGET_PROFILE}",
    ]


def second_role(profile: str, role_arn_variable: str, region_variable: str) -> list[str]:
    """Also act as the role in ``$<role_arn_variable>`` (in ``$<region_variable>``), as ``aws --profile <profile>``,
    in a step that ran ``assume_role`` first: a second profile in the same config file, renewed the same way."""
    return [
        f"printf '[profile {profile}]\\nrole_arn = %s\\ncredential_source = EcsContainer\\n"
        f"role_session_name = semif-pipeline\\nregion = %s\\n' \"${role_arn_variable}\" \"${region_variable}\" "
        '>> "$AWS_CONFIG_FILE"',
    ]


def pre_deploy_commands() -> list[str]:
    """Before a stage deploys: keep its image, then clear stacks whose first create failed.

    Reads ``image.json`` (the image step's output), ``IMAGE_REPOSITORY``, ``IMAGE_REGION``, ``DEPLOYED_TAG_PREFIX``,
    ``STAGE_NAME``, ``DEPLOY_ROLE_ARN`` (the environment's CDK deploy role) and ``STACKS`` (the stage's stacks,
    dependents first).

    1. Tags the digest ``<DEPLOYED_TAG_PREFIX><hex digest>`` in the pipeline account (once per digest and stage):
       the repository's lifecycle never expires the last images an environment was deployed with.
    2. Deletes each stack in ROLLBACK_COMPLETE. CloudFormation refuses a change set on such a stack, and only a
       failed first create ends there, so it never served and holds nothing.
    """
    return [
        # image.json: the stage's image; batch-image/image.json (GPU stages): the CPU image its Batch Transform runs.
        'for detail in image.json batch-image/image.json; do [ -f "$detail" ] || continue; '
        "digest=\"$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[\"imageDigest\"])' \"$detail\")\"; "
        'tag="${DEPLOYED_TAG_PREFIX}${digest#sha256:}"; '
        'if aws ecr describe-images --region "$IMAGE_REGION" --repository-name "$IMAGE_REPOSITORY" '
        '--image-ids imageTag="$tag" > /dev/null 2>&1; then echo "${digest} is already marked ${tag}"; else '
        'manifest="$(aws ecr batch-get-image --region "$IMAGE_REGION" --repository-name "$IMAGE_REPOSITORY" '
        f'--image-ids imageDigest="$digest" --accepted-media-types {DOCKER_MANIFEST} '
        '--query "images[0].imageManifest" --output text)" && '
        'aws ecr put-image --region "$IMAGE_REGION" --repository-name "$IMAGE_REPOSITORY" --image-tag "$tag" '
        f'--image-digest "$digest" --image-manifest "$manifest" --image-manifest-media-type {DOCKER_MANIFEST} '
        '> /dev/null && echo "marked ${digest} ${tag}: the repository keeps it while ${STAGE_NAME} may run it" '
        '|| exit 1; fi; done',
        *assume_role("DEPLOY_ROLE_ARN"),
        'for stack in $STACKS; do '
        'if ! status="$(aws cloudformation describe-stacks --stack-name "$stack" '
        '--query "Stacks[0].StackStatus" --output text 2>&1)"; then '
        'case "$status" in *"does not exist"*) echo "${stack}: not created yet"; continue ;; '
        '*) echo "cannot read ${stack}: ${status}" >&2; exit 1 ;; esac; fi; '
        'if [ "$status" = ROLLBACK_COMPLETE ]; then '
        'echo "${stack} is ROLLBACK_COMPLETE (its first create failed; it never served): deleting it so this '
        'deploy can create it again"; '
        'aws cloudformation delete-stack --stack-name "$stack" && '
        'aws cloudformation wait stack-delete-complete --stack-name "$stack" || exit 1; '
        'else echo "${stack}: ${status}"; fi; done',
    ]


def model_check_commands() -> list[str]:
    """The model check custom resource's own check, before the stage's endpoint stacks: manifest against the
    adapter's schema, the GGUF's size and S3 checksum, and the Batch Transform tarball's. Reads ``CHECK_ROLE_ARN``, ``MODEL_BUCKET``, ``MODEL_PREFIX``,
    ``MANIFEST_KEY``; runs in a checkout of the repository."""
    return [
        *assume_role("CHECK_ROLE_ARN"),
        'python3 lambda/model_check/handler.py --bucket "$MODEL_BUCKET" --model-prefix "$MODEL_PREFIX" '
        '--manifest-key "$MANIFEST_KEY" --transform-tarball',
    ]


def smoke_commands(*, chat: bool, endpoint_config: bool = True) -> list[str]:
    """Reads ``CHECK_ROLE_ARN``, ``ENDPOINT_NAME``, ``image.json`` (the digest the stage deployed), with
    ``endpoint_config`` ``ENDPOINT_CONFIG_NAME`` (the decision stack's endpoint config), and with ``chat``
    ``CHAT_ENDPOINT_NAME``.

    The endpoint must be InService on the stack's endpoint config and answer from the stage's digest: after a
    blue/green auto-rollback SageMaker keeps the endpoint InService on its previous config
    (https://docs.aws.amazon.com/sagemaker/latest/dg/deployment-guardrails-configuration.html), so the status
    alone proves nothing."""
    describe = ('described="$(aws sagemaker describe-endpoint --endpoint-name "$ENDPOINT_NAME" '
                '--query "[EndpointStatus,EndpointConfigName]" --output text)" || exit 1; set -- $described; '
                '[ "$1" = InService ] || { echo "${ENDPOINT_NAME} is $1, not InService" >&2; exit 1; }')
    if endpoint_config:
        describe += ('; [ "$2" = "$ENDPOINT_CONFIG_NAME" ] || { echo "${ENDPOINT_NAME} runs endpoint config $2, not '
                     '${ENDPOINT_CONFIG_NAME} that the stack deployed: the update did not take (a blue/green rollback '
                     'keeps the old configuration InService); see the endpoint\'s events and alarms" >&2; exit 1; }')
    commands = [
        *assume_role("CHECK_ROLE_ARN"),
        describe,
        f"echo '{json.dumps(SMOKE_REQUEST)}' > request.json",
        'aws sagemaker-runtime invoke-endpoint --endpoint-name "$ENDPOINT_NAME" '
        "--content-type application/json --body fileb://request.json response.json",
        f'python3 -c "{CHECK_DECISION}"',
    ]
    if chat:
        commands += [
            f"echo '{json.dumps(SMOKE_CHAT_REQUEST)}' > chat-request.json",
            'aws sagemaker-runtime invoke-endpoint --endpoint-name "$CHAT_ENDPOINT_NAME" '
            "--content-type application/json --body fileb://chat-request.json chat.json",
            f'python3 -c "{CHECK_CHAT}"',
        ]
    return commands


def bake_commands() -> list[str]:
    """Fail unless, for ``BAKE_SECONDS``, every endpoint in ``ENDPOINT_NAMES`` stays InService and none of the alarms
    in ``ALARM_NAMES`` is in ALARM. An alarm the role cannot read fails the bake rather than passing unseen.
    Reads ``CHECK_ROLE_ARN``, ``BAKE_POLL_SECONDS`` (default 60)."""
    return [
        *assume_role("CHECK_ROLE_ARN"),
        'echo "baking ${ENDPOINT_NAMES} for ${BAKE_SECONDS}s against the alarms ${ALARM_NAMES}"',
        'expected=$(echo $ALARM_NAMES | wc -w); end=$(( $(date +%s) + BAKE_SECONDS )); while :; do '
        'for endpoint in $ENDPOINT_NAMES; do '
        'status="$(aws sagemaker describe-endpoint --endpoint-name "$endpoint" --query EndpointStatus --output text)"'
        ' || exit 1; '
        '[ "$status" = InService ] || { echo "${endpoint} is ${status}, not InService"; exit 1; }; done; '
        'states="$(aws cloudwatch describe-alarms --alarm-names $ALARM_NAMES '
        '--query "MetricAlarms[].[AlarmName,StateValue]" --output text)" || exit 1; '
        'seen=$(printf "%s\\n" "$states" | grep -c . || true); '
        'if [ "$seen" -ne "$expected" ]; then echo "read ${seen} of the ${expected} alarms: a missing one cannot be '
        'watched"; exit 1; fi; '
        "firing=$(printf '%s\\n' \"$states\" | awk '$2 == \"ALARM\" {print $1}'); "
        'if [ -n "$firing" ]; then echo "alarms firing:" $firing; exit 1; fi; '
        '[ "$(date +%s)" -ge "$end" ] && break; sleep "${BAKE_POLL_SECONDS:-60}"; done',
        'echo "bake passed: every endpoint InService and no alarm fired"',
    ]


# ---- the release checks: the labeled regression gate, the load check, and the baseline they compare with ----------

# Where the steps install the operator tools: a virtualenv of its own, in the step's checkout of the repository.
SEMIF_TOOLS_VENV = ".semif-tools"
# The requirements of `semif[tools]` as the package itself pins them, without llama-cpp-python: a remote evaluation
# scores nothing locally, and that dependency would compile llama.cpp in the step. Reads the installed metadata
# (`pip install --no-deps ./container` first), so the pins stay in container/pyproject.toml.
TOOLS_REQUIREMENTS = (  # no double quote, dollar sign or backslash: it runs inside a double-quoted shell word
    "import importlib.metadata as m, re; "
    "reqs = [(r.partition(';')[0].strip(), r.partition(';')[2]) for r in m.requires('semif') or []]; "
    "print(*[n for n, marker in reqs "
    "if re.match(r'[A-Za-z0-9._-]+', n).group(0).lower().replace('_', '-') != 'llama-cpp-python' "
    "and (not marker.strip() or re.search(r'extra *== *.tools.', marker))], sep=chr(10))"
)


def semif_tools_install_commands() -> list[str]:
    """Install `semif-eval` and `semif-loadcheck` into ``SEMIF_TOOLS_VENV``, with the project's pins and no llama.cpp."""
    return [
        f"python3 -m venv {SEMIF_TOOLS_VENV}",
        f"{SEMIF_TOOLS_VENV}/bin/pip install --quiet --no-deps ./container",
        f'{SEMIF_TOOLS_VENV}/bin/python -c "{TOOLS_REQUIREMENTS}" > {SEMIF_TOOLS_VENV}/requirements.txt',
        f"{SEMIF_TOOLS_VENV}/bin/pip install --quiet -r {SEMIF_TOOLS_VENV}/requirements.txt",
    ]


BASELINE_PROFILE = "semif-baseline"


def gate_commands() -> list[str]:
    """The labeled regression gate: the stage's labeled decisions through its decision endpoint (`semif-eval`), judged
    against the gate's limits and, when there is one, against the report of the release prod runs now.

    Reads ``MODEL_BUCKET``, ``EVAL_DATA_KEY``, ``ENDPOINT_NAME``, ``AWS_DEFAULT_REGION``, ``MODEL_KEY_ARN``,
    ``GATE_LIMITS`` (JSON), ``REPORT_PREFIX`` and ``RELEASE_ID`` (the report goes to
    ``s3://$MODEL_BUCKET/$REPORT_PREFIX$RELEASE_ID/``); and where the baseline lives: ``BASELINE_BUCKET`` (prod's
    model bucket, which outlives a torn-down staging), ``BASELINE_KEY``, ``BASELINE_ROLE_ARN`` (prod's check role),
    ``BASELINE_REGION`` and ``BASELINE_ENDPOINT`` (prod's decision endpoint). Runs as the stage's check role, after
    ``semif_tools_install_commands``; reads the baseline as prod's check role.

    Whether the baseline exists is asked with a listing of exactly that key (ListObjectsV2, which an ``s3:prefix``
    condition governs), not read from a GetObject error: without an unconditional s3:ListBucket, S3 answers a missing
    object with 403, as it answers a refused one. A listing that fails fails the step. No baseline is a first release
    only while prod's endpoint does not exist (DescribeEndpoint: "Could not find endpoint"): once prod serves, a
    missing baseline fails the gate instead of weakening it to the absolute limits.
    """
    return [
        *second_role(BASELINE_PROFILE, "BASELINE_ROLE_ARN", "BASELINE_REGION"),
        'report="s3://${MODEL_BUCKET}/${REPORT_PREFIX}${RELEASE_ID}/"; baseline="s3://${BASELINE_BUCKET}/${BASELINE_KEY}"; '
        f'keys="$(aws --profile {BASELINE_PROFILE} s3api list-objects-v2 --bucket "$BASELINE_BUCKET" '
        '--prefix "$BASELINE_KEY" --query "Contents[].Key" --output text)" || { echo "cannot list ${baseline}: the gate '
        'cannot tell a first release from a missing baseline" >&2; exit 1; }; '
        'if printf "%s\\n" $keys | grep -qxF "$BASELINE_KEY"; then '
        f'aws --profile {BASELINE_PROFILE} s3 cp "$baseline" baseline-report.json --only-show-errors || '
        '{ echo "cannot read ${baseline}" >&2; exit 1; }; echo "baseline: ${baseline} (the release prod runs)"; '
        'set -- --baseline baseline-report.json; '
        f'elif serving="$(aws --profile {BASELINE_PROFILE} sagemaker describe-endpoint --endpoint-name '
        '"$BASELINE_ENDPOINT" --query EndpointStatus --output text 2>&1)"; then '
        'echo "no baseline at ${baseline}, but ${BASELINE_ENDPOINT} exists (${serving}): prod runs a release the gate '
        'cannot compare with; restore its report there (docs/how-to/release-gate.md, When the baseline is missing)" '
        '>&2; exit 1; '
        'else case "$serving" in *"Could not find endpoint"*) echo "no baseline at ${baseline} and no '
        '${BASELINE_ENDPOINT}: a first release, gated on the absolute limits alone"; set -- ;; '
        '*) echo "cannot tell whether ${BASELINE_ENDPOINT} exists (${serving}): a missing baseline is a first release '
        'only before prod serves" >&2; exit 1 ;; esac; fi; '
        'status=0; '
        f'{SEMIF_TOOLS_VENV}/bin/semif-eval "s3://${{MODEL_BUCKET}}/${{EVAL_DATA_KEY}}" --endpoint "$ENDPOINT_NAME" '
        '--region "$AWS_DEFAULT_REGION" --no-contextual --no-progress --kms-key-id "$MODEL_KEY_ARN" --out "$report" '
        '--limits "$GATE_LIMITS" "$@" || status=$?; '
        'case "$status" in 0) echo "gate passed; report: ${report}report.json" ;; '
        '1) echo "gate FAILED: a limit was exceeded (the table above names it; the report ${report}report.json has '
        'it under gate.failed); see docs/evaluation.md, When the gate fails" >&2; exit 1 ;; '
        '*) echo "gate could not run (semif-eval exit ${status}: 2 bad data, limits or baseline, 3 the endpoint '
        'could not be opened); no verdict was written" >&2; exit "$status" ;; esac',
    ]


def load_check_commands() -> list[str]:
    """A bounded load on the stage's decision endpoint (`semif-loadcheck`), with the client's retry policy, held
    against the load limits; `loadcheck.json` goes beside the gate's report.

    Reads ``MODEL_BUCKET``, ``EVAL_DATA_KEY``, ``ENDPOINT_NAME``, ``AWS_DEFAULT_REGION``, ``MODEL_KEY_ARN``,
    ``REPORT_PREFIX``, ``RELEASE_ID``, ``LOAD_CLIENTS``, ``LOAD_DURATION_S``, ``LOAD_MAX_ATTEMPTS``,
    ``LOAD_MAX_ELAPSED_S``, ``LOAD_REQUEST_TIMEOUT_S``, ``LOAD_LIMITS`` (JSON) and ``LOAD_BOUND_S``. The tool stops by
    itself (no request starts after the duration; one in flight ends within its retry budget); ``LOAD_BOUND_S`` is a
    hard stop beyond that, by SIGINT, on which the tool stops sending at once.
    """
    return [
        'report="s3://${MODEL_BUCKET}/${REPORT_PREFIX}${RELEASE_ID}/"; status=0; '
        f'timeout --signal=INT --kill-after=30 "$LOAD_BOUND_S" {SEMIF_TOOLS_VENV}/bin/semif-loadcheck '
        '--endpoint "$ENDPOINT_NAME" --region "$AWS_DEFAULT_REGION" --data "s3://${MODEL_BUCKET}/${EVAL_DATA_KEY}" '
        '--clients "$LOAD_CLIENTS" --duration-s "$LOAD_DURATION_S" --max-attempts "$LOAD_MAX_ATTEMPTS" '
        '--max-elapsed-s "$LOAD_MAX_ELAPSED_S" --request-timeout-s "$LOAD_REQUEST_TIMEOUT_S" --limits "$LOAD_LIMITS" '
        '--out "$report" --kms-key-id "$MODEL_KEY_ARN" --no-progress || status=$?; '
        'case "$status" in 0) echo "load check passed; report: ${report}loadcheck.json" ;; '
        '1) echo "load check FAILED: a limit was exceeded (the table above names it; ${report}loadcheck.json has '
        'it under verdict.failed)" >&2; exit 1 ;; '
        '124|130|137) echo "load check stopped after ${LOAD_BOUND_S}s, past its bound" >&2; exit 1 ;; '
        '*) echo "load check could not run (semif-loadcheck exit ${status}: 2 bad data or limits, 3 the endpoint '
        'could not be opened)" >&2; exit "$status" ;; esac',
    ]


def promote_baseline_commands() -> list[str]:
    """Once prod runs the release and answered its smoke test: the report the gate passed becomes the next release's
    baseline. Reads ``MODEL_BUCKET`` (the gated stage's bucket), ``REPORT_PREFIX`` and ``RELEASE_ID``, as the gated
    stage's check role; writes ``s3://$BASELINE_BUCKET/$BASELINE_KEY`` (prod's bucket) as ``BASELINE_ROLE_ARN``
    (prod's check role) in ``BASELINE_REGION``. The report is checked to carry a passing verdict first, and the file
    checked is the one written; S3 encrypts it with the bucket's default key (prod's model key)."""
    return [
        *second_role(BASELINE_PROFILE, "BASELINE_ROLE_ARN", "BASELINE_REGION"),
        'report="s3://${MODEL_BUCKET}/${REPORT_PREFIX}${RELEASE_ID}/report.json"; '
        'baseline="s3://${BASELINE_BUCKET}/${BASELINE_KEY}"',
        'aws s3 cp "$report" gated-report.json --only-show-errors || { echo "no readable report at ${report}: '
        'this execution\'s gate wrote none, or it cannot be read (to this role S3 answers a missing object with 403)" '
        '>&2; exit 1; }',
        "python3 -c \"import json; g = json.load(open('gated-report.json')).get('gate') or {}; "
        "assert g.get('passed') is True, 'the report carries no passing gate verdict: not promoted'; "
        "print('gate verdict: passed')\"",
        f'aws --profile {BASELINE_PROFILE} s3 cp gated-report.json "$baseline" --content-type application/json '
        '--only-show-errors',
        'echo "prod runs this release: ${report} is the baseline now (${baseline})"',
    ]
