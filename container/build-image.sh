#!/usr/bin/env bash
# Build the SemIf adapter image FROM the llama.cpp DLC, push it, and report its digest.
#
# Run by the pipeline's image steps (constructs_lib/image_build.py) and by container/buildspec.yml; by hand:
#   BASE_IMAGE=763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp@sha256:… \
#   REPOSITORY_URI=<account>.dkr.ecr.us-east-1.amazonaws.com/semif/adapter bash container/build-image.sh
#
# Contract (environment variables):
#   BASE_IMAGE            required  the DLC, pinned by digest (…/llama-cpp@sha256:…); a moving tag is refused
#   REPOSITORY_URI        required  where the image goes, <account>.dkr.ecr.<region>.amazonaws.com/<name>
#   IMAGE_TAG             optional  default: the input hash (container/ files, BASE_IMAGE, LLAMA_CPP_VARIANT)
#   CACHE_REPOSITORY_URI  optional  a mutable repository for BuildKit's registry layer cache (one tag per variant)
#   LLAMA_CPP_VARIANT     optional  auto | cpu | cuda (auto: cuda when the base image is a CUDA image)
#   GB_PER_BUILD_JOB      optional  memory one compiler job needs (default 4); jobs = min(vCPUs, RAM / this)
#   SOURCE_REVISION       optional  label org.opencontainers.image.revision; default CODEBUILD_RESOLVED_SOURCE_VERSION
#   DOCKER_BUILD_ARGS     optional  extra `docker buildx build` arguments
#   IMAGE_OUTPUT          optional  also write the image detail JSON there (the pipeline step's output)
#   AWS_REGION            optional  set by CodeBuild (AWS_DEFAULT_REGION is the fallback)
#
# Output: image-detail.json in the working directory, {"imageUri","imageDigest","imageTag","baseImage",
# "baseImageDigest","sourceRevision","buildJobs","skipped"}.
#
# A tag already in the repository builds nothing (tags are immutable and name their inputs). Two builds of the
# same tag never run at once: each variant's CodeBuild project has a concurrent-build limit of 1, so a retry
# queues behind the running build and then finds its tag.
set -euo pipefail

: "${BASE_IMAGE:?is required}" "${REPOSITORY_URI:?is required}"
case "$BASE_IMAGE" in
  *@sha256:*) ;;
  *) echo "BASE_IMAGE must be pinned by digest (…@sha256:…), got ${BASE_IMAGE}" >&2; exit 2 ;;
esac
REGION="${AWS_REGION:-${AWS_DEFAULT_REGION:-}}"
[ -n "$REGION" ] || { echo "AWS_REGION is not set" >&2; exit 2; }
REPO_REGISTRY="${REPOSITORY_URI%%/*}"
REPO_NAME="${REPOSITORY_URI#*/}"
BASE_REGISTRY="${BASE_IMAGE%%/*}"
BASE_IMAGE_DIGEST="${BASE_IMAGE##*@}"
VARIANT="${LLAMA_CPP_VARIANT:-auto}"
SOURCE_REVISION="${SOURCE_REVISION:-${CODEBUILD_RESOLVED_SOURCE_VERSION:-unknown}}"
CONTEXT_DIR=.
if [ ! -f Dockerfile ] && [ -f container/Dockerfile ]; then CONTEXT_DIR=container; fi

input_hash() {
  # Every file of the build context directory (Dockerfile, scripts, adapter sources), the base and the variant.
  (
    cd "$CONTEXT_DIR"
    find . -type f ! -name '*.pyc' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 \
      | LC_ALL=C sort -z | xargs -0 sha256sum
    printf '%s\n%s\n' "$BASE_IMAGE" "$VARIANT"
  ) | sha256sum | cut -c1-40
}
IMAGE_TAG="${IMAGE_TAG:-$(input_hash)}"

echo "Logging in to ${REPO_REGISTRY}"
aws ecr get-login-password --region "$REGION" | docker login --username AWS --password-stdin "$REPO_REGISTRY"
if [[ "$BASE_REGISTRY" =~ ^[0-9]{12}\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com$ ]]; then
  echo "Logging in to the DLC registry ${BASE_REGISTRY}"
  aws ecr get-login-password --region "${BASH_REMATCH[1]}" | docker login --username AWS --password-stdin "$BASE_REGISTRY"
fi

SKIPPED=false
BUILD_JOBS=0
if aws ecr describe-images --region "$REGION" --repository-name "$REPO_NAME" --image-ids imageTag="$IMAGE_TAG" >/dev/null 2>&1; then
  echo "${REPOSITORY_URI}:${IMAGE_TAG} already exists: the inputs are unchanged, nothing to build"
  SKIPPED=true
else
  # As many compiler jobs as the RAM holds (nvcc is killed for memory long before the CPUs run out).
  cpus="$(nproc)"
  mem_gb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 / 1024 ))
  BUILD_JOBS=$(( mem_gb / ${GB_PER_BUILD_JOB:-4} ))
  [ "$BUILD_JOBS" -le "$cpus" ] || BUILD_JOBS="$cpus"
  [ "$BUILD_JOBS" -ge 1 ] || BUILD_JOBS=1
  echo "Building ${REPOSITORY_URI}:${IMAGE_TAG} from ${BASE_IMAGE} with ${BUILD_JOBS} jobs (${cpus} vCPUs, ${mem_gb} GB)"
  cache_args=()
  if [ -n "${CACHE_REPOSITORY_URI:-}" ]; then
    cache_ref="${CACHE_REPOSITORY_URI}:${VARIANT}"
    cache_args=(--cache-from "type=registry,ref=${cache_ref}"
                --cache-to "type=registry,ref=${cache_ref},mode=max,image-manifest=true,oci-mediatypes=true")
  fi
  # The docker-container driver is what can export a registry cache.
  docker buildx create --name semif --driver docker-container --use >/dev/null 2>&1 || docker buildx use semif
  # shellcheck disable=SC2086  # DOCKER_BUILD_ARGS is a list of words on purpose
  docker buildx build --progress=plain \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg BASE_IMAGE_DIGEST="$BASE_IMAGE_DIGEST" \
    --build-arg SOURCE_REVISION="$SOURCE_REVISION" \
    --build-arg IMAGE_INPUT_HASH="$IMAGE_TAG" \
    --build-arg LLAMA_CPP_VARIANT="$VARIANT" \
    --build-arg BUILD_JOBS="$BUILD_JOBS" \
    "${cache_args[@]}" \
    ${DOCKER_BUILD_ARGS:-} \
    --tag "${REPOSITORY_URI}:${IMAGE_TAG}" --push \
    "$CONTEXT_DIR"
fi

IMAGE_DIGEST="$(aws ecr describe-images --region "$REGION" --repository-name "$REPO_NAME" \
  --image-ids imageTag="$IMAGE_TAG" --query 'imageDetails[0].imageDigest' --output text)"
[[ "$IMAGE_DIGEST" =~ ^sha256:[0-9a-f]{64}$ ]] || { echo "no digest for ${IMAGE_TAG}: ${IMAGE_DIGEST}" >&2; exit 1; }
IMAGE_URI="${REPOSITORY_URI}@${IMAGE_DIGEST}"
printf '{"imageUri":"%s","imageDigest":"%s","imageTag":"%s","baseImage":"%s","baseImageDigest":"%s","sourceRevision":"%s","buildJobs":%s,"skipped":%s}\n' \
  "$IMAGE_URI" "$IMAGE_DIGEST" "$IMAGE_TAG" "$BASE_IMAGE" "$BASE_IMAGE_DIGEST" "$SOURCE_REVISION" "$BUILD_JOBS" "$SKIPPED" \
  > image-detail.json
if [ -n "${IMAGE_OUTPUT:-}" ]; then mkdir -p "$(dirname "$IMAGE_OUTPUT")"; cp image-detail.json "$IMAGE_OUTPUT"; fi
echo "Image ${IMAGE_URI}"
