"""SEMIF_REQUIRE_GPU: a GPU variant must not come up on the CPU. On this CPU-only build of
llama.cpp the check must fire, which is exactly what a failed CUDA initialisation looks like."""

from __future__ import annotations

import json

import pytest

from semif.serving.config import Settings, SettingsError


def test_require_gpu_is_off_unless_set(model_path):
    assert Settings.from_env({"SEMIF_MODEL_PATH": str(model_path)}).require_gpu is False
    assert Settings.from_env({"SEMIF_MODEL_PATH": str(model_path), "SEMIF_REQUIRE_GPU": "1"}).require_gpu is True


def test_require_gpu_with_zero_offloaded_layers_is_a_settings_error(model_path):
    with pytest.raises(SettingsError, match="SEMIF_REQUIRE_GPU"):
        Settings.from_env({"SEMIF_MODEL_PATH": str(model_path), "SEMIF_REQUIRE_GPU": "1", "SEMIF_N_GPU_LAYERS": "0"})


def test_serve_exits_6_with_a_clear_log_line_when_the_gpu_is_required_but_absent(start_serve):
    proc = start_serve(wait=False, SEMIF_REQUIRE_GPU="1")
    assert proc.proc.wait(timeout=120) == 6
    lines = proc.log_lines()
    refused = [line for line in lines if line.get("message") == "GPU required but unavailable"]
    assert len(refused) == 1, proc.log_text()
    assert "no GPU backend came up" in refused[0]["error"]
    assert not any(line.get("message") == "model loaded" for line in lines)
    assert "serve: SEMIF_REQUIRE_GPU is set" in proc.log_text()


def test_serve_starts_on_the_cpu_when_the_gpu_is_not_required(start_serve):
    proc = start_serve(SEMIF_REQUIRE_GPU="0")
    loaded = [line for line in proc.log_lines() if line.get("message") == "model loaded"]
    assert loaded and loaded[0]["model"]["n_gpu_layers"] == 0, json.dumps(loaded)
