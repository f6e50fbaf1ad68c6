"""The SEMIF_* definition (semif.serving.settings_contract) as the container reads it, and as the docs state it.

The CDK side of the same contract (config -> environment -> container): tests/cdk/test_adapter_settings_contract.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from semif.serving.config import Settings, SettingsError
from semif.serving.settings_contract import (CONTRACT, OPERATOR, SCOPES, SECRET, SETTINGS, Setting, read_environment)

REPO = Path(__file__).resolve().parents[1]
CONFIGURATION_DOC = REPO / "docs" / "reference" / "configuration.md"


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A model directory as SageMaker lays it out, with a calibration file shipped beside the GGUF."""
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "fit.json").write_text("{}")
    return tmp_path


def _env(model_dir: Path, **variables: str) -> dict[str, str]:
    return {"SEMIF_MODEL_DIR": str(model_dir), **variables}


def test_every_setting_is_named_once_with_a_known_scope_and_a_default_that_reads_back():
    assert len({s.name for s in SETTINGS}) == len(SETTINGS)
    for setting in SETTINGS:
        assert setting.name.startswith("SEMIF_") and setting.scope in SCOPES, setting.name
        if setting.default is not None:
            assert setting.parse({setting.name: setting.render(setting.default)}) == setting.default, setting.name


def test_every_settings_field_is_a_defined_setting():
    """Settings.from_env builds its fields from the definition: a field added without a definition fails here."""
    fields = set(Settings.__dataclass_fields__)
    defined = {s.key for s in SETTINGS if not s.name.endswith("_SECRET_ARN") and s.key != "model_dir"}
    assert fields == defined


def test_unset_settings_read_as_the_definitions_defaults(model_dir):
    settings = Settings.from_env(_env(model_dir))
    for setting in SETTINGS:
        if setting.default is not None and setting.key in Settings.__dataclass_fields__:
            assert getattr(settings, setting.key) == setting.default, setting.name
    assert settings.model_path == model_dir / "model.gguf"
    assert settings.body_budget_bytes == 4 * settings.max_body_bytes


def _non_default(setting: Setting):
    """A valid value other than the default, derived from the definition alone."""
    if setting.type == "bool":
        return not setting.default
    if setting.type == "choice":
        return next(c for c in setting.choices if c != setting.default)
    if setting.type in ("int", "float"):
        step = 1 if setting.type == "int" else 0.5
        start = setting.default if setting.default is not None else setting.minimum
        value = start + step
        return start - step if setting.maximum is not None and value > setting.maximum else value
    if setting.type == "path":
        return "calibration/fit.json"
    return f"value-of-{setting.key}"


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.scope != SECRET and not s.name.endswith("_SECRET_ARN")
                                     and s.key not in ("model_path", "model_dir")], ids=lambda s: s.name)
def test_each_setting_is_read_through_the_definition(setting, model_dir):
    value = _non_default(setting)
    variables = {setting.name: setting.render(value)}
    if setting.key == "n_seq":
        variables["SEMIF_BATCHING"] = "1"  # read only when batching is on
    if setting.key == "body_budget_bytes":
        value = 8 * (1 << 20)
        variables[setting.name] = str(value)
    settings = Settings.from_env(_env(model_dir, **variables))
    expected = model_dir / value if setting.type == "path" else value
    assert getattr(settings, setting.key) == expected


def test_errors_name_the_variable_in_the_container_s_words(model_dir):
    for variables, message in [
        ({"SEMIF_N_BATCH": "many"}, "SEMIF_N_BATCH='many' is not an integer"),
        ({"SEMIF_N_BATCH": "0"}, "SEMIF_N_BATCH=0 must be >= 1"),
        ({"SEMIF_QUEUE_TIMEOUT_S": "soon"}, "SEMIF_QUEUE_TIMEOUT_S='soon' is not a number"),
        ({"SEMIF_PREFIX_CACHE": "maybe"}, "SEMIF_PREFIX_CACHE='maybe' is not a boolean"),
        ({"SEMIF_SCORING": "Vote"}, "SEMIF_SCORING='vote' must be one of label, sequence"),
        ({"SEMIF_MAX_OPTIONS": "256"}, "SEMIF_MAX_OPTIONS=256 must be <= 255"),
        ({"SEMIF_BATCHING": "1", "SEMIF_N_SEQ": "257"}, "SEMIF_N_SEQ=257 must be <= 256 (llama.cpp's most parallel"),
    ]:
        with pytest.raises(SettingsError, match=re.escape(message)):
            Settings.from_env(_env(model_dir, **variables))


def test_a_relative_calibration_path_names_a_file_shipped_in_the_model_directory(model_dir, tmp_path_factory):
    settings = Settings.from_env(_env(model_dir, SEMIF_CALIBRATION_PATH="calibration/fit.json"))
    assert settings.calibration_path == model_dir / "calibration" / "fit.json"
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "fit.json"
    elsewhere.write_text("{}")
    assert Settings.from_env(_env(model_dir, SEMIF_CALIBRATION_PATH=str(elsewhere))).calibration_path == elsewhere
    with pytest.raises(SettingsError, match=r"SEMIF_CALIBRATION_PATH='calibration/other.json' is not a file \(under "
                                            r"SEMIF_MODEL_DIR="):
        Settings.from_env(_env(model_dir, SEMIF_CALIBRATION_PATH="calibration/other.json"))


def test_read_environment_needs_no_model_and_keeps_the_cross_setting_checks():
    assert read_environment({})["max_queue"] == 8
    with pytest.raises(SettingsError, match="SEMIF_BODY_BUDGET_BYTES=4095 must be >= SEMIF_MAX_BODY_BYTES"):
        read_environment({"SEMIF_MAX_BODY_BYTES": "4096", "SEMIF_BODY_BUDGET_BYTES": "4095"})
    with pytest.raises(SettingsError, match="SEMIF_REQUIRE_GPU=1 with SEMIF_N_GPU_LAYERS=0"):
        read_environment({"SEMIF_REQUIRE_GPU": "1", "SEMIF_N_GPU_LAYERS": "0"})


# ---- secrets by reference ----

SECRET_ARN_PATTERN = "arn:aws:secretsmanager:us-east-1:123456789012:secret:{}"


@pytest.fixture
def secrets_manager(monkeypatch):
    """Secrets Manager as moto serves it in-process (the resolver and boto3 are the real ones)."""
    moto = pytest.importorskip("moto")
    boto3 = pytest.importorskip("boto3")
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    with moto.mock_aws():
        yield boto3.client("secretsmanager", region_name="us-east-1")


def test_a_secret_given_by_reference_is_read_at_startup(model_dir, secrets_manager):
    arn = secrets_manager.create_secret(Name="semif/api-key", SecretString="s3cr3t key")["ARN"]
    settings = Settings.from_env(_env(model_dir, SEMIF_API_KEY_SECRET_ARN=arn))
    assert settings.api_key == "s3cr3t key"
    assert Settings.from_env(_env(model_dir)).api_key is None


def test_an_unreadable_secret_stops_startup_naming_the_reference(model_dir, secrets_manager):
    missing = SECRET_ARN_PATTERN.format("semif/absent-AbCdEf")
    with pytest.raises(SettingsError, match=f"SEMIF_LOG_HASH_KEY_SECRET_ARN: cannot read secret {re.escape(missing)}"):
        Settings.from_env(_env(model_dir, SEMIF_LOG_HASH_KEY_SECRET_ARN=missing))
    with pytest.raises(SettingsError, match="SEMIF_API_KEY_SECRET_ARN='semif/api-key' is not a Secrets Manager"):
        Settings.from_env(_env(model_dir, SEMIF_API_KEY_SECRET_ARN="semif/api-key"))
    with pytest.raises(SettingsError, match="SEMIF_API_KEY and SEMIF_API_KEY_SECRET_ARN are both set"):
        Settings.from_env(_env(model_dir, SEMIF_API_KEY="k", SEMIF_API_KEY_SECRET_ARN=missing))


# ---- the reference table ----

def _doc_rows() -> dict[str, list[str]]:
    """`SEMIF_*` rows of the settings table: variable -> its cells."""
    text = CONFIGURATION_DOC.read_text(encoding="utf-8")
    section = text.split("## The `SEMIF_*` environment", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `SEMIF_"):
            rows[cells[0].strip("`")] = cells
    return rows


def doc_columns(setting: Setting) -> list[str]:
    """The table's generated columns for one setting: variable, scope, type, default, allowed."""
    return [f"`{setting.name}`", setting.scope, setting.type, setting.describe_default(), setting.describe_allowed()]


def test_configuration_doc_table_matches_the_definition():
    rows = _doc_rows()
    assert list(rows) == [s.name for s in SETTINGS], "the table lists every setting once, in the definition's order"
    for setting in SETTINGS:
        assert rows[setting.name][:5] == doc_columns(setting), setting.name
        assert rows[setting.name][5], f"{setting.name}: say what it means"


def test_configuration_doc_says_how_each_scope_is_set_per_environment():
    text = CONFIGURATION_DOC.read_text(encoding="utf-8")
    for scope in (OPERATOR, CONTRACT, SECRET):
        assert re.search(rf"^- \*\*{scope}\*\*", text, re.MULTILINE), scope
