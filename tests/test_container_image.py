"""The adapter image without Docker: the Dockerfile and buildspec parsed and exercised, and the image's
`serve` entrypoint run as a process against a SageMaker-style model directory."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from semif.serving.engine.manifest import MANIFEST_NAME, load_manifest
from semif.tools.package_model import main as package_model

ROOT = Path(__file__).resolve().parents[1]
CONTAINER = ROOT / "container"
DOCKERFILE = CONTAINER / "Dockerfile"
BUILDSPEC = CONTAINER / "buildspec.yml"
BUILD_SCRIPT = CONTAINER / "build-image.sh"
ENTRYPOINT = CONTAINER / "image" / "entrypoint.sh"
SERVE = Path(sys.executable).parent / "serve"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DLC_CPU = "763104351884.dkr.ecr.us-west-2.amazonaws.com/llama-cpp@sha256:" + "b" * 64
BUILD_TOOLS = re.compile(r"\b(gcc|gcc-c\+\+|g\+\+|make|cmake|git|ninja(-build)?|cuda-nvcc\S*|\S+-devel\S*)\b")


# --- a small Dockerfile reader -------------------------------------------------------------------


@dataclass
class Instruction:
    keyword: str
    args: str


@dataclass
class Stage:
    base: str
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]

    def args_declared(self) -> set[str]:
        return {re.split(r"[=\s]", a, maxsplit=1)[0] for a in self.all("ARG")}


def parse_dockerfile(text: str) -> tuple[list[Instruction], list[Stage]]:
    """Instructions before the first FROM, and the stages. Handles continuations and comments."""
    logical, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue  # comment lines inside a continued instruction are dropped by Docker too
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a line continuation"

    preamble: list[Instruction] = []
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        instruction = Instruction(keyword.upper(), args.strip())
        if instruction.keyword == "FROM":
            parts = instruction.args.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(parts[0], name))
        elif stages:
            stages[-1].instructions.append(instruction)
        else:
            preamble.append(instruction)
    return preamble, stages


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"{args!r} is not exec form"
    return value


def env_pairs(args: str) -> dict[str, str]:
    return dict(token.split("=", 1) for token in shlex.split(args))


@pytest.fixture(scope="module")
def dockerfile():
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def final_stage(dockerfile) -> Stage:
    return dockerfile[1][-1]


# --- Dockerfile ----------------------------------------------------------------------------------


def test_both_stages_build_from_the_dlc_named_by_the_base_image_arg(dockerfile):
    preamble, stages = dockerfile

    assert [i.args.split("=")[0] for i in preamble if i.keyword == "ARG"] == ["BASE_IMAGE"]
    default = next(i.args for i in preamble if i.keyword == "ARG").split("=", 1)[1]
    assert re.fullmatch(r"763104351884\.dkr\.ecr\.[a-z0-9-]+\.amazonaws\.com/llama-cpp:server-sagemaker-(cpu|cuda)-v1", default)
    assert [(s.base, s.name) for s in stages] == [("${BASE_IMAGE}", "builder"), ("${BASE_IMAGE}", "runtime")]


def test_the_final_stage_runs_serve_on_8080_through_the_cuda_compat_entrypoint(final_stage):
    assert exec_form(final_stage.all("ENTRYPOINT")[-1]) == ["/opt/semif/bin/entrypoint.sh"]
    assert "image/entrypoint.sh /opt/semif/bin/entrypoint.sh" in final_stage.all("COPY")
    assert exec_form(final_stage.all("CMD")[-1]) == ["serve"]
    assert final_stage.all("EXPOSE") == ["8080"]
    env = {}
    for args in final_stage.all("ENV"):
        env.update(env_pairs(args))
    assert env["PATH"].startswith("/opt/semif/venv/bin:")
    assert env["SEMIF_PORT"] == "8080" and env["SEMIF_MODEL_DIR"] == "/opt/ml/model"
    assert any("ln -sf /opt/semif/venv/bin/serve /usr/bin/serve" in run for run in final_stage.all("RUN"))


def test_the_dlcs_own_libllama_is_kept_off_the_loader_path(dockerfile):
    for stage in dockerfile[1]:
        env = {}
        for args in stage.all("ENV"):
            env.update(env_pairs(args))
        assert "LD_LIBRARY_PATH" in env, f"stage {stage.name} inherits the DLC's LD_LIBRARY_PATH"
        assert "/opt/llama.cpp" not in env["LD_LIBRARY_PATH"]
        assert "${LD_LIBRARY_PATH}" not in env["LD_LIBRARY_PATH"]


def test_the_final_stage_runs_as_root_as_sagemakers_container_contract_asks(final_stage):
    """SageMaker documents that it expects every container to run as root; the image says so last, and makes no
    other user for anything to switch to."""
    user = final_stage.all("USER")[-1]

    assert user == "root"
    assert final_stage.instructions[-1].keyword in ("CMD", "ENTRYPOINT", "EXPOSE")
    last_user = max(n for n, i in enumerate(final_stage.instructions) if i.keyword == "USER")
    after_user = final_stage.instructions[last_user:]
    assert [i.keyword for i in after_user if i.keyword in ("USER", "RUN", "COPY", "ADD")] == ["USER"]
    assert not [run for run in final_stage.all("RUN") if "useradd" in run or "adduser" in run]


def test_no_build_tools_are_installed_in_the_final_stage(final_stage):
    installs = [run for run in final_stage.all("RUN") if "install" in run]

    assert installs, "the final stage installs its runtime packages"
    for run in installs:
        assert not BUILD_TOOLS.search(run), f"build tool in the final stage: {run}"
    assert [c for c in final_stage.all("COPY") if "--from=builder" in c] == ["--from=builder /opt/semif /opt/semif"]


def test_compiler_jobs_come_from_the_build_script_not_a_fixed_guess(dockerfile):
    builder = dockerfile[1][0]
    assert "BUILD_JOBS=4" in builder.all("ARG")
    env = {}
    for args in builder.all("ENV"):
        env.update(env_pairs(args))
    assert env["CMAKE_BUILD_PARALLEL_LEVEL"] == "${BUILD_JOBS}"


def test_the_builder_compiles_the_pinned_llama_cpp_python_from_source_with_cuda_when_asked(dockerfile):
    builder = dockerfile[1][0]
    serve_extra = tomllib.loads((CONTAINER / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    pinned = next(d for d in serve_extra if d.startswith("llama-cpp-python=="))
    runs = " ".join(builder.all("RUN"))

    assert f"LLAMA_CPP_PYTHON_VERSION={pinned.split('==')[1]}" in builder.all("ARG")
    assert 'pip install --no-binary llama-cpp-python "llama-cpp-python==${LLAMA_CPP_PYTHON_VERSION}"' in runs
    assert "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES}" in runs
    assert "-DGGML_NATIVE=OFF" in runs and "GGML_NATIVE=ON" not in runs
    assert BUILD_TOOLS.search(runs)



def test_the_image_installs_the_adapter_with_its_serve_extra(dockerfile):
    """The base install is the client alone: without the `serve` extra the image would have no HTTP server."""
    runs = [r for r in dockerfile[1][0].all("RUN") if "/src/container" in r]
    assert len(runs) == 1, runs
    assert re.search(r'pip install "/src/container\[serve\]"', runs[0]), runs[0]

def test_the_image_compiles_llama_cpp_with_the_same_x86_flags_as_make(dockerfile):
    makefile = (ROOT / "Makefile").read_text()
    make_flags = re.search(r"^LLAMA_CMAKE_ARGS \?= (.+)$", makefile, re.M).group(1).split()
    image_flags = re.search(r'x86_64\) cpu_args="([^"]+)"', " ".join(dockerfile[1][0].all("RUN"))).group(1).split()

    assert image_flags == make_flags
    assert "-DGGML_AMX_TILE=OFF" in image_flags


def test_the_image_is_labelled_with_its_source_revision_and_base(final_stage):
    labels = {}
    for args in final_stage.all("LABEL"):
        labels.update(env_pairs(args))

    assert "SOURCE_REVISION=unknown" in final_stage.all("ARG")
    assert labels["org.opencontainers.image.revision"] == "${SOURCE_REVISION}"
    assert labels["org.opencontainers.image.base.name"] == "${BASE_IMAGE}"
    assert labels["org.opencontainers.image.base.digest"] == "${BASE_IMAGE_DIGEST}"


def test_every_variable_a_stage_uses_from_build_args_is_declared_in_that_stage(dockerfile):
    preamble, stages = dockerfile
    build_args = {a.split("=")[0] for a in (i.args for i in preamble if i.keyword == "ARG")}
    for stage in stages:
        build_args |= stage.args_declared()
    for stage in stages:
        declared = stage.args_declared()
        for instruction in stage.instructions:
            for name in re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", instruction.args):
                if name in build_args:
                    assert name in declared, f"stage {stage.name}: {instruction.keyword} uses ${name} without ARG {name}"


def test_every_run_step_is_valid_posix_shell(dockerfile):
    for stage in dockerfile[1]:
        for run in stage.all("RUN"):
            check = subprocess.run(["sh", "-n", "-c", run], capture_output=True, text=True)
            assert check.returncode == 0, f"{stage.name}: {check.stderr}\n{run}"


def _dockerignored(path: str, patterns: list[str]) -> bool:
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        pattern = pattern.replace("**/", "*")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            ignored = not negate
    return ignored


def test_the_build_context_holds_what_the_dockerfile_copies_and_nothing_else():
    patterns = [p.strip() for p in (CONTAINER / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    copied = []
    for stage in parse_dockerfile(DOCKERFILE.read_text())[1]:
        for args in stage.all("COPY"):
            if "--from=" not in args:
                copied.append(args.split()[0])
    sources = [p.relative_to(CONTAINER).as_posix() for p in (CONTAINER / "semif").rglob("*.py")]

    assert sorted(copied) == ["image/entrypoint.sh", "image/llama_abi_check.py", "pyproject.toml", "semif"]
    for path in ["pyproject.toml", "image/entrypoint.sh", "image/llama_abi_check.py", *sources]:
        assert not _dockerignored(path, patterns), path
    for path in ["tests/test_x.py", ".venv/bin/python", "semif/__pycache__/app.cpython-312.pyc",
                 "model.gguf", "buildspec.yml", "build-image.sh", "semif/x/model.gguf"]:
        assert _dockerignored(path, patterns), path


# --- buildspec and build-image.sh: their commands run with stand-ins for docker and aws --------------


DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"

# The stand-ins keep ECR's state for two tags: the immutable image tag in $STUB_STATE and its mutable candidate-<tag>
# in $STUB_STATE.candidate. A push (`docker push`, or the image exporter's) stores the candidate with the media type the
# daemon would write ($PUSHED_MEDIA_TYPE, default a Docker manifest); `put-image` tags the candidate's manifest, and is
# refused on a tag that exists (the repository is immutable but for candidate-*). ECR has no delete here: the build role
# may not delete.
STUB = """#!/usr/bin/env bash
printf '%s\\n' "$(basename "$0") $*" >> "$STUB_LOG"
state="$STUB_STATE"
candidate="$STUB_STATE.candidate"
digest="sha256:$(printf 'a%.0s' {1..64})"
case "$(basename "$0") $*" in
  "aws ecr get-login-password"*) echo secret ;;
  "docker login"*) cat > /dev/null ;;
  "docker info"*) echo "${IMAGE_STORE:-}" ;;
  "docker buildx build"*"push=true"*) echo "${PUSHED_MEDIA_TYPE:-$DOCKER_MANIFEST}" > "$candidate" ;;
  "docker push"*cache*) ;;
  "docker push"*candidate-*)
    [ -z "$PUSH_FAILS" ] || { echo "denied" >&2; exit 1; }
    echo "${PUSHED_MEDIA_TYPE:-$DOCKER_MANIFEST}" > "$candidate" ;;
  "docker push"*) echo "an immutable tag was pushed directly" >&2; exit 1 ;;
  "aws ecr batch-delete-image"*) echo "AccessDenied: ecr:BatchDeleteImage" >&2; exit 254 ;;
  "aws ecr describe-images"*candidate-*"imageManifestMediaType,imageDigest"*)
    [ -f "$candidate" ] || exit 254; printf '%s\\t%s\\n' "$(cat "$candidate")" "$digest" ;;
  "aws ecr describe-images"*"imageManifestMediaType"*) [ -f "$state" ] || exit 254; cat "$state" ;;
  "aws ecr describe-images"*"--query"*) [ -f "$state" ] || exit 254; echo "$digest" ;;
  "aws ecr describe-images"*) [ -f "$state" ] || exit 254 ;;
  "aws ecr batch-get-image"*"imageDigest=$digest"*"--output json"*)
    [ -f "$candidate" ] || exit 254; echo '"{\\n   \\"schemaVersion\\": 2\\n}"' ;;
  "aws ecr put-image"*)
    if [ -n "$PUSH_RACE" ]; then echo "$DOCKER_MANIFEST" > "$state"; fi
    [ ! -f "$state" ] || { echo "ImageTagAlreadyExistsException" >&2; exit 254; }
    args="$*"; manifest="${args##*--image-manifest file://}"; manifest="${manifest%% *}"
    [ "$(cat "$manifest")" = "$(printf '{\\n   \\"schemaVersion\\": 2\\n}')" ] || { echo "not the manifest ECR stored" >&2; exit 254; }
    cp "$candidate" "$state" ;;
esac
"""


def run_buildspec(tmp_path: Path, env: dict[str, str]) -> tuple[int, list[str], dict[str, str], str]:
    """Run the phases as CodeBuild does: commands in order, each a script of its own that sees the plain variables
    of the ones before, a failing command ends its phase, and post_build runs only while the build is succeeding.

    ``env`` may hold ``EXISTING_MEDIA_TYPE`` (the tag is already in ECR, stored so), ``PUSHED_MEDIA_TYPE``,
    ``PUSH_RACE`` (another build tags the image first) and ``PUSH_FAILS``."""
    spec = yaml.safe_load(BUILDSPEC.read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("aws", "docker"):
        (bin_dir / tool).write_text(STUB)
        (bin_dir / tool).chmod(0o755)
    shutil.copy(DOCKERFILE, tmp_path / "Dockerfile")
    shutil.copy(BUILD_SCRIPT, tmp_path / "build-image.sh")
    state = tmp_path / "ecr-tag"
    env = dict(env)
    if "EXISTING_MEDIA_TYPE" in env:
        state.write_text(env.pop("EXISTING_MEDIA_TYPE") + "\n")
    # CodeBuild runs each command as a script of its own: plain variables and the working directory carry over to
    # the next command, shell functions and arrays do not. Each command here runs in its own bash, started from
    # the plain variables the previous one left.
    # Outside the build context (tmp_path): build-image.sh hashes every file there into the tag.
    steps_dir = tmp_path.parent / f"{tmp_path.name}-steps"
    steps_dir.mkdir(exist_ok=True)
    carried = steps_dir / "carried.sh"
    carried.write_text("CODEBUILD_BUILD_SUCCEEDING=1\n")
    save = ("for _v in $(compgen -v); do case \"$(declare -p \"$_v\" 2>/dev/null)\" in "
            "'declare -- '*|'declare -x '*) declare -p \"$_v\" | sed 's/^declare -[-x] //' ;; esac; done "
            f"| grep -Ev '^(BASH|_v=|SHLVL|PWD|OLDPWD|_=)' > {carried}.next; mv {carried}.next {carried}")
    lines = []
    for phase in ("install", "pre_build", "build", "post_build"):
        for number, command in enumerate(spec["phases"].get(phase, {}).get("commands", []), 1):
            step = steps_dir / f"{phase}-{number}.sh"
            step.write_text(f"source {carried}\n{command}\n_rc=$?\n{save}\nexit $_rc\n")
            lines.append(f'bash {step} || {{ echo "FAILED {phase} command {number}" >&2; exit 1; }}')
    exported = spec["env"]["exported-variables"]
    lines.append(f"source {carried}\n" + "".join(f'echo "EXPORT {name}=${{{name}}}"\n' for name in exported))
    script = steps_dir / "build.sh"
    script.write_text("\n".join(lines))
    log = tmp_path / "stub.log"
    log.touch()
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_LOG": str(log), "STUB_STATE": str(state),
                "DOCKER_MANIFEST": DOCKER_MANIFEST, "HOME": str(tmp_path), **env}
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=60)
    exports = dict(line[len("EXPORT "):].split("=", 1) for line in proc.stdout.splitlines() if line.startswith("EXPORT "))
    return proc.returncode, log.read_text().splitlines(), exports, proc.stderr


BUILD_ENV = {
    "BASE_IMAGE": DLC_CPU,
    "REPOSITORY_URI": "111122223333.dkr.ecr.eu-west-1.amazonaws.com/semif/adapter",
    "IMAGE_TAG": "inputs-3f9a1c",
    "AWS_REGION": "eu-west-1",
    "CODEBUILD_RESOLVED_SOURCE_VERSION": "0a6b83b",
}
IMAGE_REF = "111122223333.dkr.ecr.eu-west-1.amazonaws.com/semif/adapter:inputs-3f9a1c"
CANDIDATE_REF = "111122223333.dkr.ecr.eu-west-1.amazonaws.com/semif/adapter:candidate-inputs-3f9a1c"
PUT_IMAGE = ("aws ecr put-image --region eu-west-1 --repository-name semif/adapter --image-tag inputs-3f9a1c "
             "--image-digest sha256:" + "a" * 64 + " --image-manifest file://candidate-manifest.json "
             f"--image-manifest-media-type {DOCKER_MANIFEST}")


def _builds(calls: list[str]) -> list[list[str]]:
    return [shlex.split(c) for c in calls if c.startswith("docker buildx build")]


def _buildx(calls: list[str]) -> list[str]:
    """The build of the image itself (a cached build also builds the compile stage on its own first)."""
    (build,) = [b for b in _builds(calls) if "--target" not in b]
    return build


def test_buildspec_declares_its_contract_and_exports_the_digest():
    spec = yaml.safe_load(BUILDSPEC.read_text())
    header = BUILDSPEC.read_text().split("version:")[0]

    assert spec["version"] == 0.2
    assert {"IMAGE_DIGEST", "IMAGE_URI"} <= set(spec["env"]["exported-variables"])
    for name in ("BASE_IMAGE", "REPOSITORY_URI", "IMAGE_TAG", "AWS_REGION", "AWS_ACCOUNT_ID", "SOURCE_REVISION",
                 "CACHE_REPOSITORY_URI", "GB_PER_BUILD_JOB"):
        assert re.search(rf"^#\s+{name}\s", header, re.M), f"{name} is not documented in the contract"
    assert spec["artifacts"]["files"] == ["image-detail.json"]


def test_buildspec_logs_in_to_both_registries_builds_from_the_pinned_base_and_pushes_the_input_hash_tag(tmp_path):
    code, calls, exports, stderr = run_buildspec(tmp_path, BUILD_ENV)

    assert code == 0, stderr
    logins = [c for c in calls if c.startswith("docker login")]
    assert logins == [
        "docker login --username AWS --password-stdin 111122223333.dkr.ecr.eu-west-1.amazonaws.com",
        "docker login --username AWS --password-stdin 763104351884.dkr.ecr.us-west-2.amazonaws.com",
    ]
    assert "aws ecr get-login-password --region us-west-2" in calls  # the DLC registry's own region
    build = _buildx(calls)
    assert f"BASE_IMAGE={DLC_CPU}" in build  # exactly the digest config pinned: no pull-then-pin of a moving tag
    assert "BASE_IMAGE_DIGEST=sha256:" + "b" * 64 in build
    assert "SOURCE_REVISION=0a6b83b" in build and "IMAGE_INPUT_HASH=inputs-3f9a1c" in build
    assert build[build.index("--tag") + 1] == CANDIDATE_REF
    assert build[-1] == "."
    assert calls.index(f"docker push {CANDIDATE_REF}") < calls.index(PUT_IMAGE)
    assert not [c for c in calls if c.startswith("docker pull")]
    digest = "sha256:" + "a" * 64
    assert exports["IMAGE_DIGEST"] == digest
    assert exports["IMAGE_URI"] == f"{BUILD_ENV['REPOSITORY_URI']}@{digest}"
    assert exports["BASE_IMAGE_DIGEST"] == "sha256:" + "b" * 64
    detail = json.loads((tmp_path / "image-detail.json").read_text())
    assert detail["imageUri"] == exports["IMAGE_URI"] and detail["sourceRevision"] == "0a6b83b"
    assert detail["skipped"] is False and detail["imageManifestMediaType"] == DOCKER_MANIFEST


def test_the_image_is_built_by_the_daemons_own_buildkit_without_attestations(tmp_path):
    """No builder container (its moby/buildkit image would come from Docker Hub, anonymously), and no provenance
    or SBOM attestation (they turn the tag into an OCI image index, which SageMaker's CreateModel refuses)."""
    code, calls, _, stderr = run_buildspec(tmp_path, {**BUILD_ENV, "CACHE_REPOSITORY_URI": "r/cache"})

    assert code == 0, stderr
    assert not [c for c in calls if c.startswith(("docker buildx create", "docker buildx use", "docker run"))]
    builds = _builds(calls)
    assert len(builds) == 2  # the compile stage for the cache, then the image
    for build in builds:
        assert build[build.index("--builder") + 1] == "default"
        assert "--provenance=false" in build and "--sbom=false" in build
        # Pushed by `docker push` from the daemon's image store, which writes Docker manifests.
        assert not [a for a in build if a.startswith(("--push", "--output", "--cache-to"))]


def test_a_push_stored_as_an_oci_index_fails_the_build_before_the_immutable_tag_exists(tmp_path):
    """The media type is read from the mutable candidate tag: the immutable tag is never made for an image SageMaker
    refuses, so nothing has to be deleted (the build role may not delete)."""
    code, calls, exports, stderr = run_buildspec(tmp_path, {**BUILD_ENV, "PUSHED_MEDIA_TYPE": OCI_INDEX})

    assert code != 0
    assert OCI_INDEX in stderr and "accepts only" in stderr and DOCKER_MANIFEST in stderr
    assert f"docker push {CANDIDATE_REF}" in calls
    assert not [c for c in calls if c.startswith(("aws ecr put-image", "aws ecr batch-delete-image"))]
    assert not (tmp_path / "ecr-tag").exists()
    assert not (tmp_path / "image-detail.json").exists() and "IMAGE_DIGEST" not in {k for k, v in exports.items() if v}


def test_the_immutable_tag_is_the_checked_candidates_manifest_put_byte_for_byte(tmp_path):
    code, calls, exports, stderr = run_buildspec(tmp_path, BUILD_ENV)

    assert code == 0, stderr
    check = calls.index("aws ecr describe-images --region eu-west-1 --repository-name semif/adapter --image-ids "
                        "imageTag=candidate-inputs-3f9a1c --query imageDetails[0].[imageManifestMediaType,imageDigest] "
                        "--output text")
    assert calls.index(f"docker push {CANDIDATE_REF}") < check < calls.index(PUT_IMAGE)
    assert (tmp_path / "ecr-tag").read_text().strip() == DOCKER_MANIFEST
    assert not [c for c in calls if c.startswith("docker push") and c.endswith(":inputs-3f9a1c")]


def test_an_existing_tag_sagemaker_would_refuse_fails_with_the_command_that_deletes_it(tmp_path):
    """Such a tag predates the candidate check; the build may not delete it, and an immutable tag cannot be replaced."""
    code, calls, exports, stderr = run_buildspec(tmp_path, {**BUILD_ENV, "EXISTING_MEDIA_TYPE": OCI_INDEX})

    assert code != 0
    assert ("aws ecr batch-delete-image --region eu-west-1 --repository-name semif/adapter --image-ids "
            "imageTag=inputs-3f9a1c" in " ".join(stderr.split()))
    assert not [c for c in calls if c.startswith(("docker buildx", "docker push", "aws ecr batch-delete-image"))]


def test_buildspec_with_an_already_pushed_tag_builds_nothing_and_still_exports_the_digest(tmp_path):
    code, calls, exports, stderr = run_buildspec(tmp_path, {**BUILD_ENV, "EXISTING_MEDIA_TYPE": DOCKER_MANIFEST})

    assert code == 0, stderr
    assert not [c for c in calls if c.startswith(("docker buildx", "docker push", "docker pull"))]
    assert not [c for c in calls if c.startswith("aws ecr batch-delete-image")]
    assert exports["IMAGE_DIGEST"] == "sha256:" + "a" * 64
    assert json.loads((tmp_path / "image-detail.json").read_text())["skipped"] is True


def test_a_build_that_loses_the_tag_to_a_build_of_the_same_inputs_reports_that_image(tmp_path):
    code, calls, exports, stderr = run_buildspec(tmp_path, {**BUILD_ENV, "PUSH_RACE": "1"})

    assert code == 0, stderr
    assert PUT_IMAGE in calls
    assert exports["IMAGE_DIGEST"] == "sha256:" + "a" * 64
    assert not [c for c in calls if c.startswith("aws ecr batch-delete-image")]


def test_a_failed_push_fails_the_build(tmp_path):
    code, calls, exports, stderr = run_buildspec(tmp_path, {**BUILD_ENV, "PUSH_FAILS": "1"})

    assert code != 0
    assert "was not pushed" in stderr and not (tmp_path / "image-detail.json").exists()


def test_on_the_containerd_image_store_the_exporter_pushes_with_docker_media_types(tmp_path):
    """A containerd image store (new Docker 29 installs) would push what BuildKit built; its image exporter can be
    told to write Docker media types."""
    code, calls, exports, stderr = run_buildspec(tmp_path, {**BUILD_ENV,
                                                            "IMAGE_STORE": "io.containerd.snapshotter.v1"})
    assert code == 0, stderr
    build = _buildx(calls)
    assert build[build.index("--output") + 1] == f"type=image,name={CANDIDATE_REF},push=true,oci-mediatypes=false"
    assert "--load" not in build and not [c for c in calls if c.startswith("docker push")]
    assert PUT_IMAGE in calls
    assert "--provenance=false" in build and exports["IMAGE_DIGEST"] == "sha256:" + "a" * 64


def test_buildspec_without_a_base_image_fails_before_touching_any_registry(tmp_path):
    env = {k: v for k, v in BUILD_ENV.items() if k != "BASE_IMAGE"}

    code, calls, _, stderr = run_buildspec(tmp_path, env)

    assert code != 0
    assert "BASE_IMAGE" in stderr
    assert calls == []


def test_a_base_image_named_by_a_moving_tag_is_refused(tmp_path):
    env = {**BUILD_ENV, "BASE_IMAGE": "763104351884.dkr.ecr.us-west-2.amazonaws.com/llama-cpp:server-sagemaker-cpu-v1"}

    code, calls, _, stderr = run_buildspec(tmp_path, env)

    assert code != 0
    assert "must be pinned by digest" in stderr
    assert calls == []


def test_the_all_zero_placeholder_base_digest_is_refused_with_the_command_that_looks_the_digest_up(tmp_path):
    env = {**BUILD_ENV, "BASE_IMAGE": DLC_CPU.replace("b" * 64, "0" * 64), "LLAMA_CPP_VARIANT": "cuda"}

    code, calls, _, stderr = run_buildspec(tmp_path, env)

    assert code != 0
    assert calls == []
    assert ("aws ecr batch-get-image --region us-west-2 --registry-id 763104351884 --repository-name llama-cpp "
            "--image-ids imageTag=server-sagemaker-cuda-v1 --query 'images[0].imageId.imageDigest' --output text"
            in " ".join(stderr.split()))


def test_compiler_jobs_fit_the_build_machines_ram(tmp_path):
    mem_gb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) // 1024 // 1024
    cpus = os.cpu_count()
    for gb_per_job, expected in ((1024, 1), (1, min(cpus, mem_gb))):
        run_dir = tmp_path / str(gb_per_job)
        run_dir.mkdir()
        code, calls, _, stderr = run_buildspec(run_dir, {**BUILD_ENV, "GB_PER_BUILD_JOB": str(gb_per_job)})
        assert code == 0, stderr
        assert f"BUILD_JOBS={expected}" in _buildx(calls), (gb_per_job, expected)
        assert json.loads((run_dir / "image-detail.json").read_text())["buildJobs"] == expected


def test_the_layer_cache_keeps_the_compile_stage_and_the_image_per_variant(tmp_path):
    cache = "111122223333.dkr.ecr.eu-west-1.amazonaws.com/semif/adapter-build-cache"
    code, calls, _, stderr = run_buildspec(tmp_path, {**BUILD_ENV, "CACHE_REPOSITORY_URI": cache,
                                                       "LLAMA_CPP_VARIANT": "cuda"})
    assert code == 0, stderr
    (stage,) = [b for b in _builds(calls) if "--target" in b]
    assert stage[stage.index("--target") + 1] == "builder"
    assert stage[stage.index("--tag") + 1] == f"{cache}:cuda-builder" and "BUILDKIT_INLINE_CACHE=1" in stage
    build = _buildx(calls)
    sources = [build[i + 1] for i, a in enumerate(build) if a == "--cache-from"]
    assert sources == [f"type=registry,ref={cache}:cuda-builder", f"type=registry,ref={cache}:cuda"]
    assert "BUILDKIT_INLINE_CACHE=1" in build and f"{cache}:cuda" in build
    assert f"docker push {cache}:cuda-builder" in calls and f"docker push {cache}:cuda" in calls
    assert calls.index(f"docker push {CANDIDATE_REF}") < calls.index(f"docker push {cache}:cuda")


def test_the_default_tag_is_a_hash_of_the_build_inputs(tmp_path):
    """Same inputs, same tag (so a retry finds its image); any input change, a new tag."""
    env = {k: v for k, v in BUILD_ENV.items() if k != "IMAGE_TAG"}

    def tag(run: str, **extra) -> str:
        run_dir = tmp_path / run
        shutil.copytree(context, run_dir)
        code, _, exports, stderr = run_buildspec(run_dir, {**env, **extra})
        assert code == 0, stderr
        return exports["IMAGE_TAG"]

    context = tmp_path / "context"
    (context / "semif").mkdir(parents=True)
    (context / "semif" / "app.py").write_text("v1")
    first = tag("a")
    assert re.fullmatch(r"[0-9a-f]{40}", first)
    assert tag("b") == first
    (context / "semif" / "__pycache__").mkdir()
    (context / "semif" / "__pycache__" / "app.cpython-312.pyc").write_bytes(b"\0")
    assert tag("c") == first  # bytecode is not an input
    assert tag("d", LLAMA_CPP_VARIANT="cuda") != first
    assert tag("e", BASE_IMAGE=DLC_CPU.replace("b" * 64, "c" * 64)) != first
    (context / "semif" / "app.py").write_text("v2")
    assert tag("f") != first


# --- the llama.cpp ABI check the image build runs -------------------------------------------------


ABI_CHECK = CONTAINER / "image" / "llama_abi_check.py"


@pytest.fixture(scope="module")
def installed_llama_cpp() -> dict[str, Path]:
    """The llama.cpp this test environment compiled and installed with llama-cpp-python: what the image does."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    paths = {"bindings": site / "llama_cpp" / "llama_cpp.py", "header": site / "include" / "llama.h",
             "include": site / "include", "library": site / "llama_cpp" / "lib" / "libllama.so"}
    for name, path in paths.items():
        assert path.exists(), f"{name}: {path} (install llama-cpp-python from source: make setup)"
    return paths


def _abi_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ABI_CHECK), *args], capture_output=True, text=True, timeout=120)


def test_the_abi_check_passes_on_the_llama_cpp_the_bindings_were_built_with(installed_llama_cpp):
    paths = installed_llama_cpp
    result = _abi_check("--bindings", str(paths["bindings"]), "--header", str(paths["header"]),
                        "--include", str(paths["include"]), "--library", str(paths["library"]), "--cc", "gcc")
    assert result.returncode == 0, result.stderr
    assert "exports every bound function" in result.stdout


def _drifted_header(installed: dict[str, Path], tmp_path: Path, edit) -> Path:
    header = tmp_path / "llama.h"
    header.write_text(edit(installed["header"].read_text()))
    return header


def test_a_field_added_to_a_struct_passed_by_value_fails_the_check(installed_llama_cpp, tmp_path):
    """The drift seen between 0.3.36's bindings and upstream llama.h: llama_context_params grew a field."""
    header = _drifted_header(installed_llama_cpp, tmp_path, lambda text: text.replace(
        "struct llama_context_params {", "struct llama_context_params {\n        uint32_t n_new_field;", 1))
    result = _abi_check("--bindings", str(installed_llama_cpp["bindings"]), "--header", str(header))
    assert result.returncode == 1
    assert "struct llama_context_params: fields differ (header has ['n_new_field'] the bindings lack)" in result.stderr


def test_a_same_named_field_of_another_width_fails_the_size_probe(installed_llama_cpp, tmp_path):
    header = _drifted_header(installed_llama_cpp, tmp_path, lambda text: text.replace(
        "uint32_t n_ctx;", "uint64_t n_ctx;", 1))
    result = _abi_check("--bindings", str(installed_llama_cpp["bindings"]), "--header", str(header),
                        "--include", str(installed_llama_cpp["include"]), "--cc", "gcc")
    assert result.returncode == 1
    assert "struct llama_context_params: C size/offsets" in result.stderr


def test_a_renumbered_enum_and_a_removed_function_fail_the_check(installed_llama_cpp, tmp_path):
    def drift(text: str) -> str:
        text = re.sub(r"LLAMA_VOCAB_TYPE_BPE\s*=\s*2", "LLAMA_VOCAB_TYPE_BPE = 7", text, count=1)
        return re.sub(r"LLAMA_API\s+void\s+llama_backend_init\s*\(\s*void\s*\)\s*;", "", text, count=1)

    header = _drifted_header(installed_llama_cpp, tmp_path, drift)
    result = _abi_check("--bindings", str(installed_llama_cpp["bindings"]), "--header", str(header))
    assert result.returncode == 1
    assert "enum LLAMA_VOCAB_TYPE_BPE: header 7, bindings 2" in result.stderr
    assert "function llama_backend_init: bound, but not declared in the header" in result.stderr


def test_a_library_missing_a_bound_symbol_fails_the_check(installed_llama_cpp, tmp_path):
    """E.g. the DLC's libllama from another commit: here, a library that exports nothing of llama's."""
    other = next(p for p in installed_llama_cpp["library"].parent.iterdir() if p.name.startswith("libggml-base.so"))
    result = _abi_check("--bindings", str(installed_llama_cpp["bindings"]), "--header",
                        str(installed_llama_cpp["header"]), "--library", str(other))
    assert result.returncode == 1
    assert "symbol llama_backend_init: not exported by" in result.stderr


def test_the_image_build_gates_on_the_abi_check_and_records_the_dlcs(dockerfile):
    builder = dockerfile[1][0]
    runs = [r for r in builder.all("RUN") if "llama_abi_check.py" in r]
    assert len(runs) == 1
    gate, record = runs[0].split("&& {", 1)
    assert '--library "${site}/llama_cpp/lib/libllama.so"' in gate and "|| true" not in gate
    assert "/opt/llama.cpp/bin/libllama.so" in record and "DLC_ABI_REPORT.txt" in record
    # Whether the DLC's plugin backends could be loaded by our process: the loader entry point libggml exports.
    assert "ggml_backend_load_all_from_path" in record and "libggml-*.so" in record
    install = next(i for i, r in enumerate(builder.all("RUN")) if "pip install --no-binary llama-cpp-python" in r)
    assert builder.all("RUN").index(runs[0]) == install + 1  # checked before anything else is installed


# --- the CUDA forward-compatibility entrypoint ------------------------------------------------------


def run_entrypoint(tmp_path: Path, *, driver: str | None, compat: str | None) -> tuple[str, str]:
    """Run the image's entrypoint with a stand-in nvidia-smi; it execs a command that prints LD_LIBRARY_PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    if driver is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho {driver}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    compat_dir = tmp_path / "compat"
    if compat is not None:
        compat_dir.mkdir(exist_ok=True)
        (compat_dir / f"libcuda.so.{compat}").write_bytes(b"")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SEMIF_CUDA_COMPAT_DIR": str(compat_dir),
           "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64"}
    proc = subprocess.run(["sh", str(ENTRYPOINT), "sh", "-c", 'echo "$LD_LIBRARY_PATH"'], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip(), proc.stderr


def test_entrypoint_uses_cuda_compat_only_when_the_host_driver_is_older(tmp_path):
    path, log = run_entrypoint(tmp_path / "old", driver="535.54.03", compat="580.65.06")
    assert path == f"{tmp_path / 'old' / 'compat'}:/usr/local/nvidia/lib64"
    assert "535.54.03 < compat driver 580.65.06" in log
    path, _ = run_entrypoint(tmp_path / "new", driver="580.95.05", compat="580.65.06")
    assert path == "/usr/local/nvidia/lib64"


def test_entrypoint_on_a_cpu_image_only_runs_the_command(tmp_path):
    path, log = run_entrypoint(tmp_path, driver=None, compat=None)
    assert path == "/usr/local/nvidia/lib64" and log == ""


# --- the entrypoint, run as SageMaker runs it ----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def sagemaker_model_dir(tmp_path_factory) -> Path:
    """/opt/ml/model as SageMaker lays it out for an uncompressed S3 prefix, made by the packaging CLI."""
    model_dir = tmp_path_factory.mktemp("opt_ml") / "model"
    assert package_model(["package", "--out-dir", str(model_dir), "--no-progress"]) == 0
    return model_dir


def _serve(model_dir: Path, port: int) -> subprocess.Popen:
    assert SERVE.exists(), f"{SERVE} is missing: install the adapter (pip install -e ./container)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEMIF_")}
    env.update(SEMIF_MODEL_DIR=str(model_dir), SEMIF_HOST="127.0.0.1", SEMIF_PORT=str(port), SEMIF_N_THREADS="2")
    return subprocess.Popen([str(SERVE), "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.stdout.read() if proc.stdout else ""


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_serve_answers_ping_and_invocations_for_a_model_in_a_sagemaker_model_dir(sagemaker_model_dir):
    port = _free_port()
    proc = _serve(sagemaker_model_dir, port)
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = _get(f"http://127.0.0.1:{port}/ping")
                if status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        assert status == 200, f"/ping never answered 200 (exit {proc.poll()})"

        body = json.dumps({"decision": {
            "id": "support-route",
            "state": "The customer cannot receive a password reset email.",
            "question": "Which queue should handle this request?",
            "options": [{"id": "account_access", "description": "Account access support."},
                        {"id": "billing", "description": "Billing support."}],
        }}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            result = json.loads(response.read())
    finally:
        output = _stop(proc)

    assert result["option_ids"] == ["account_access", "billing"], output
    assert len(result["probabilities"]) == 2 and abs(sum(result["probabilities"]) - 1) < 1e-6
    assert result["choice"] in result["option_ids"]
    assert result["model"]["sha256"] == load_manifest(sagemaker_model_dir / MANIFEST_NAME).sha256


def test_serve_exits_non_zero_when_the_model_no_longer_matches_its_manifest(sagemaker_model_dir, tmp_path):
    tampered_dir = tmp_path / "model"
    tampered_dir.mkdir()
    shutil.copy(sagemaker_model_dir / MANIFEST_NAME, tampered_dir / MANIFEST_NAME)
    payload = bytearray((sagemaker_model_dir / EMBEDDED_FILE).read_bytes())
    payload[len(payload) // 2] ^= 0x01
    (tampered_dir / EMBEDDED_FILE).write_bytes(bytes(payload))

    proc = _serve(tampered_dir, _free_port())
    try:
        code = proc.wait(timeout=60)
    finally:
        output = _stop(proc)

    assert code != 0
    assert "sha256" in output
