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
# Checks the decision answer: a choice among the options and probabilities that sum to 1.
CHECK_DECISION = (
    "import json,sys; r=json.load(open('response.json')); ids=r['option_ids']; p=r['probabilities']; "
    "assert ids==['billing','technical','sales'], ids; assert r['choice'] in ids, r['choice']; "
    "assert len(p)==3 and abs(sum(p)-1)<1e-3, p; print('decision ok:', r['choice'], p)"
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
        "digest=\"$(python3 -c 'import json; print(json.load(open(\"image.json\"))[\"imageDigest\"])')\"",
        'tag="${DEPLOYED_TAG_PREFIX}${digest#sha256:}"',
        'if aws ecr describe-images --region "$IMAGE_REGION" --repository-name "$IMAGE_REPOSITORY" '
        '--image-ids imageTag="$tag" > /dev/null 2>&1; then echo "${digest} is already marked ${tag}"; else '
        'manifest="$(aws ecr batch-get-image --region "$IMAGE_REGION" --repository-name "$IMAGE_REPOSITORY" '
        f'--image-ids imageDigest="$digest" --accepted-media-types {DOCKER_MANIFEST} '
        '--query "images[0].imageManifest" --output text)" && '
        'aws ecr put-image --region "$IMAGE_REGION" --repository-name "$IMAGE_REPOSITORY" --image-tag "$tag" '
        f'--image-digest "$digest" --image-manifest "$manifest" --image-manifest-media-type {DOCKER_MANIFEST} '
        '> /dev/null && echo "marked ${digest} ${tag}: the repository keeps it while ${STAGE_NAME} may run it"; fi',
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


def smoke_commands(*, chat: bool) -> list[str]:
    """Reads ``CHECK_ROLE_ARN``, ``ENDPOINT_NAME`` and, with ``chat``, ``CHAT_ENDPOINT_NAME``."""
    commands = [
        *assume_role("CHECK_ROLE_ARN"),
        'test "$(aws sagemaker describe-endpoint --endpoint-name "$ENDPOINT_NAME" '
        '--query EndpointStatus --output text)" = InService',
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
