#!/usr/bin/env bash
# Build the SemIf adapter image FROM the llama.cpp DLC, push it, and report its digest.
#
# Run by the pipeline's image steps (constructs_lib/image_build.py) and by container/buildspec.yml; by hand:
#   BASE_IMAGE=763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp@sha256:… \
#   REPOSITORY_URI=<account>.dkr.ecr.us-east-1.amazonaws.com/semif/adapter bash container/build-image.sh
#
# Contract (environment variables):
#   BASE_IMAGE            required  the DLC, pinned by digest (…/llama-cpp@sha256:…); a moving tag or the all-zero
#                                   placeholder is refused
#   REPOSITORY_URI        required  where the image goes, <account>.dkr.ecr.<region>.amazonaws.com/<name>
#   IMAGE_TAG             optional  default: the input hash (container/ files, BASE_IMAGE, LLAMA_CPP_VARIANT)
#   CACHE_REPOSITORY_URI  optional  a mutable repository for the layer cache: <variant>-builder (the compile stage)
#                                   and <variant> (the final image), both with BuildKit's inline cache
#   LLAMA_CPP_VARIANT     optional  auto | cpu | cuda (auto: cuda when the base image is a CUDA image)
#   GB_PER_BUILD_JOB      optional  memory one compiler job needs (default 4); jobs = min(vCPUs, RAM / this)
#   SOURCE_REVISION       optional  label org.opencontainers.image.revision; default CODEBUILD_RESOLVED_SOURCE_VERSION
#   DOCKER_BUILD_ARGS     optional  extra `docker buildx build` arguments
#   IMAGE_OUTPUT          optional  also write the image detail JSON there (the pipeline step's output)
#   AWS_REGION            optional  set by CodeBuild (AWS_DEFAULT_REGION is the fallback)
#
# Output: image-detail.json in the working directory, {"imageUri","imageDigest","imageTag","imageManifestMediaType",
# "baseImage","baseImageDigest","sourceRevision","buildJobs","skipped"}.
#
# The build runs on the Docker daemon's own BuildKit (the `default` builder, `docker` driver): nothing is pulled
# from Docker Hub (a `docker-container` builder would pull moby/buildkit anonymously, and CodeBuild's shared
# addresses hit its rate limit), and CodeBuild's local Docker layer cache applies.
#
# SageMaker's CreateModel accepts only Docker image manifests (schema 2), not OCI manifests or image indexes:
# provenance and SBOM attestations (on by default since buildx 0.10) are off, and the manifest media type ECR stores
# is checked before the immutable tag exists. The image is pushed as candidate-<tag>, a tag the repository leaves
# mutable (its one exclusion from immutability); only a Docker manifest is then tagged <tag>, by PutImage of that
# manifest (https://docs.aws.amazon.com/AmazonECR/latest/APIReference/API_PutImage.html). So an immutable tag never
# names an image SageMaker cannot run, and the build needs no ecr:BatchDeleteImage. (The check cannot run in the cache
# repository: PutImage needs the manifest's layers in the repository it tags.)
#
# A tag already in the repository (with a Docker manifest) builds nothing: tags are immutable and name their
# inputs. Two builds of one tag may run at once (a hand start-build beside the pipeline's); the one that tags
# second finds the tag taken and reports the image the first one tagged.
set -euo pipefail

DOCKER_MANIFEST=application/vnd.docker.distribution.manifest.v2+json
PLACEHOLDER_DIGEST="sha256:$(printf '0%.0s' {1..64})"

: "${BASE_IMAGE:?is required}" "${REPOSITORY_URI:?is required}"
case "$BASE_IMAGE" in
  *@sha256:*) ;;
  *) echo "BASE_IMAGE must be pinned by digest (…@sha256:…), got ${BASE_IMAGE}" >&2; exit 2 ;;
esac
REPO_REGISTRY="${REPOSITORY_URI%%/*}"
REPO_NAME="${REPOSITORY_URI#*/}"
BASE_REGISTRY="${BASE_IMAGE%%/*}"
BASE_REPOSITORY="${BASE_IMAGE#*/}"; BASE_REPOSITORY="${BASE_REPOSITORY%@*}"
BASE_IMAGE_DIGEST="${BASE_IMAGE##*@}"
VARIANT="${LLAMA_CPP_VARIANT:-auto}"
if [ "$BASE_IMAGE_DIGEST" = "$PLACEHOLDER_DIGEST" ]; then
  case "$VARIANT" in cuda) dlc_tag=server-sagemaker-cuda-v1 ;; cpu) dlc_tag=server-sagemaker-cpu-v1 ;;
                     *) dlc_tag="server-sagemaker-cpu-v1 (or server-sagemaker-cuda-v1)" ;; esac
  dlc_account="${BASE_REGISTRY%%.*}"; dlc_region="${BASE_REGISTRY#*.dkr.ecr.}"; dlc_region="${dlc_region%%.*}"
  echo "BASE_IMAGE carries the all-zero placeholder digest: pin the DLC in config/environments.json (dlc_images)" \
       "with the digest from: aws ecr batch-get-image --region ${dlc_region} --registry-id ${dlc_account}" \
       "--repository-name ${BASE_REPOSITORY} --image-ids imageTag=${dlc_tag}" \
       "--query 'images[0].imageId.imageDigest' --output text" >&2
  exit 2
fi
REGION="${AWS_REGION:-${AWS_DEFAULT_REGION:-}}"
[ -n "$REGION" ] || { echo "AWS_REGION is not set" >&2; exit 2; }
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

tag_exists() {
  aws ecr describe-images --region "$REGION" --repository-name "$REPO_NAME" --image-ids imageTag="$1" >/dev/null 2>&1
}
manifest_media_type() {
  aws ecr describe-images --region "$REGION" --repository-name "$REPO_NAME" --image-ids imageTag="$1" \
    --query 'imageDetails[0].imageManifestMediaType' --output text
}
# Only candidate-* tags are mutable in the repository (AdapterImageRepository's exclusion filter).
CANDIDATE_TAG="candidate-${IMAGE_TAG}"

echo "Logging in to ${REPO_REGISTRY}"
aws ecr get-login-password --region "$REGION" | docker login --username AWS --password-stdin "$REPO_REGISTRY"
if [[ "$BASE_REGISTRY" =~ ^[0-9]{12}\.dkr\.ecr\.([a-z0-9-]+)\.amazonaws\.com$ ]]; then
  echo "Logging in to the DLC registry ${BASE_REGISTRY}"
  aws ecr get-login-password --region "${BASH_REMATCH[1]}" | docker login --username AWS --password-stdin "$BASE_REGISTRY"
fi

SKIPPED=false
BUILD_JOBS=0
if tag_exists "$IMAGE_TAG"; then
  found="$(manifest_media_type "$IMAGE_TAG")"
  if [ "$found" = "$DOCKER_MANIFEST" ]; then
    echo "${REPOSITORY_URI}:${IMAGE_TAG} already exists: the inputs are unchanged, nothing to build"
    SKIPPED=true
  else
    # Only a build from before the candidate check (or a hand push) leaves such a tag; this build may not delete.
    echo "${REPOSITORY_URI}:${IMAGE_TAG} exists as ${found}, which SageMaker refuses, and the tag is immutable:" \
         "delete it (aws ecr batch-delete-image --region ${REGION} --repository-name ${REPO_NAME}" \
         "--image-ids imageTag=${IMAGE_TAG}) and build again" >&2
    exit 1
  fi
fi

if [ "$SKIPPED" = false ]; then
  # As many compiler jobs as the RAM holds (nvcc is killed for memory long before the CPUs run out).
  cpus="$(nproc)"
  mem_gb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 / 1024 ))
  BUILD_JOBS=$(( mem_gb / ${GB_PER_BUILD_JOB:-4} ))
  [ "$BUILD_JOBS" -le "$cpus" ] || BUILD_JOBS="$cpus"
  [ "$BUILD_JOBS" -ge 1 ] || BUILD_JOBS=1
  echo "Building ${REPOSITORY_URI}:${IMAGE_TAG} from ${BASE_IMAGE} with ${BUILD_JOBS} jobs (${cpus} vCPUs, ${mem_gb} GB)"
  # shellcheck disable=SC2206  # DOCKER_BUILD_ARGS is a list of words on purpose
  build=(docker buildx build --builder default --progress=plain --provenance=false --sbom=false
         --build-arg BASE_IMAGE="$BASE_IMAGE"
         --build-arg BASE_IMAGE_DIGEST="$BASE_IMAGE_DIGEST"
         --build-arg SOURCE_REVISION="$SOURCE_REVISION"
         --build-arg IMAGE_INPUT_HASH="$IMAGE_TAG"
         --build-arg LLAMA_CPP_VARIANT="$VARIANT"
         --build-arg BUILD_JOBS="$BUILD_JOBS"
         ${DOCKER_BUILD_ARGS:-})
  cache_from=()
  cache_images=()
  if [ -n "${CACHE_REPOSITORY_URI:-}" ]; then
    # The docker driver caches inline, in the image it pushes, and only the stages it exports: the compile stage
    # (the hours of a CUDA build) is pushed as an image of its own so the next build can reuse it.
    compile_cache="${CACHE_REPOSITORY_URI}:${VARIANT}-builder"
    final_cache="${CACHE_REPOSITORY_URI}:${VARIANT}"
    "${build[@]}" --target builder --cache-from "type=registry,ref=${compile_cache}" \
      --build-arg BUILDKIT_INLINE_CACHE=1 --tag "$compile_cache" --load "$CONTEXT_DIR"
    cache_images=("$compile_cache")
    cache_from=(--cache-from "type=registry,ref=${compile_cache}" --cache-from "type=registry,ref=${final_cache}"
                --build-arg BUILDKIT_INLINE_CACHE=1)
  fi
  pushed=true
  # The classic image store pushes Docker manifests. The containerd image store (the default of new Docker 29
  # installs) pushes what BuildKit built, so there the image exporter pushes, with Docker media types.
  case "$(docker info --format '{{range .DriverStatus}}{{index . 1}} {{end}}' 2>/dev/null || true)" in
    *io.containerd.snapshotter*)
      "${build[@]}" ${cache_from[@]+"${cache_from[@]}"} \
        --output "type=image,name=${REPOSITORY_URI}:${CANDIDATE_TAG},push=true,oci-mediatypes=false" "$CONTEXT_DIR" \
        || pushed=false ;;
    *)
      final_tags=()
      [ -z "${final_cache:-}" ] || { final_tags=(--tag "$final_cache"); cache_images+=("$final_cache"); }
      "${build[@]}" ${cache_from[@]+"${cache_from[@]}"} ${final_tags[@]+"${final_tags[@]}"} \
        --tag "${REPOSITORY_URI}:${CANDIDATE_TAG}" --load "$CONTEXT_DIR"
      docker push "${REPOSITORY_URI}:${CANDIDATE_TAG}" || pushed=false ;;
  esac
  [ "$pushed" = true ] || { echo "${REPOSITORY_URI}:${CANDIDATE_TAG} was not pushed (see above)" >&2; exit 1; }
  # The cache is an optimisation: a failed cache push never fails the build.
  for image in ${cache_images[@]+"${cache_images[@]}"}; do
    docker push "$image" || echo "warning: could not push the layer cache ${image}" >&2
  done
  read -r MEDIA_TYPE CANDIDATE_DIGEST < <(aws ecr describe-images --region "$REGION" --repository-name "$REPO_NAME" \
    --image-ids imageTag="$CANDIDATE_TAG" --query 'imageDetails[0].[imageManifestMediaType,imageDigest]' --output text) || true
  if [ "$MEDIA_TYPE" != "$DOCKER_MANIFEST" ]; then
    echo "${REPOSITORY_URI}:${CANDIDATE_TAG} was stored as ${MEDIA_TYPE}; SageMaker's CreateModel accepts only" \
         "${DOCKER_MANIFEST}, so ${IMAGE_TAG} was not tagged; check the Docker daemon's image store and buildx" \
         "attestations" >&2
    exit 1
  fi
  # The manifest exactly as ECR stores it (JSON-quoted by the CLI, unquoted here byte for byte), tagged immutably.
  aws ecr batch-get-image --region "$REGION" --repository-name "$REPO_NAME" --image-ids imageDigest="$CANDIDATE_DIGEST" \
    --accepted-media-types "$DOCKER_MANIFEST" --query 'images[0].imageManifest' --output json \
    | python3 -c 'import json,sys; sys.stdout.write(json.load(sys.stdin))' > candidate-manifest.json
  if ! aws ecr put-image --region "$REGION" --repository-name "$REPO_NAME" --image-tag "$IMAGE_TAG" \
       --image-digest "$CANDIDATE_DIGEST" --image-manifest file://candidate-manifest.json \
       --image-manifest-media-type "$DOCKER_MANIFEST" >/dev/null; then
    [ "$(manifest_media_type "$IMAGE_TAG" 2>/dev/null)" = "$DOCKER_MANIFEST" ] \
      || { echo "${REPOSITORY_URI}:${IMAGE_TAG} could not be tagged (see above)" >&2; exit 1; }
    echo "${REPOSITORY_URI}:${IMAGE_TAG} was tagged by another build of the same inputs meanwhile: using it"
  fi
fi

IMAGE_DIGEST="$(aws ecr describe-images --region "$REGION" --repository-name "$REPO_NAME" \
  --image-ids imageTag="$IMAGE_TAG" --query 'imageDetails[0].imageDigest' --output text)"
[[ "$IMAGE_DIGEST" =~ ^sha256:[0-9a-f]{64}$ ]] || { echo "no digest for ${IMAGE_TAG}: ${IMAGE_DIGEST}" >&2; exit 1; }
IMAGE_URI="${REPOSITORY_URI}@${IMAGE_DIGEST}"
printf '{"imageUri":"%s","imageDigest":"%s","imageTag":"%s","imageManifestMediaType":"%s","baseImage":"%s","baseImageDigest":"%s","sourceRevision":"%s","buildJobs":%s,"skipped":%s}\n' \
  "$IMAGE_URI" "$IMAGE_DIGEST" "$IMAGE_TAG" "$DOCKER_MANIFEST" "$BASE_IMAGE" "$BASE_IMAGE_DIGEST" "$SOURCE_REVISION" \
  "$BUILD_JOBS" "$SKIPPED" > image-detail.json
if [ -n "${IMAGE_OUTPUT:-}" ]; then mkdir -p "$(dirname "$IMAGE_OUTPUT")"; cp image-detail.json "$IMAGE_OUTPUT"; fi
echo "Image ${IMAGE_URI}"
