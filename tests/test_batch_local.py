"""End to end on this machine: `semif-batch local` through the container contract (the adapter app over the
real embedded model, in-process), then `semif-batch report`. Every good output line must equal the answer
to that record sent alone, computed for real by another engine with no prefix cache and no memo."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from serving import REPO, make_settings

SAMPLE = REPO / "data" / "decisions-sample.jsonl"
BROKEN = {
    3: "{\"decision\": {\"id\": \"cut-off\", \"state\": \"The printer",  # truncated JSON
    7: json.dumps({"decision": {"id": "one-option", "state": "Anything.", "question": "Which?", "options": [{"id": "a"}]}}),
    12: json.dumps({"tickets": ["no contract has this shape"]}),
    20: json.dumps({"id": "s1-bad", "state": "x", "questions": {"q": {"type": "box"}}}),
}
# Fields that describe a run rather than the answer: ids, times and what the cache happened to hold.
RUN_FIELDS = {"request_id", "timing"}
CACHE_FIELDS = {"cached_tokens", "evaluated_tokens"}


def comparable(answer: dict) -> dict:
    out = {k: v for k, v in answer.items() if k not in RUN_FIELDS}
    out["prompt"] = {k: v for k, v in answer["prompt"].items() if k not in CACHE_FIELDS}
    if "content_free" in out["prompt"]:  # the prior and the raw answer compare; whether it was held does not
        out["prompt"]["content_free"] = {k: v for k, v in out["prompt"]["content_free"].items()
                                         if k not in ("held", "evaluated_tokens")}
    return out


@pytest.fixture(scope="module")
def batch_files(tmp_path_factory, model_path):
    from semif.tools import batch

    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    records = [json.dumps(batch.request_from_labeled_row(row)) for row in rows]
    labels = [json.dumps({"answer": row["answer"]}) for row in rows]
    for position in sorted(BROKEN):
        records.insert(position, BROKEN[position])
        labels.insert(position, "{}")
    folder = tmp_path_factory.mktemp("batch")
    (folder / "in.jsonl").write_text("\n".join(records) + "\n")
    (folder / "labels.jsonl").write_text("\n".join(labels) + "\n")
    threads = str(os.cpu_count() or 2)
    old = {k: os.environ.get(k) for k in ("SEMIF_N_THREADS", "SEMIF_MODEL_DIR")}
    os.environ.update(SEMIF_N_THREADS=threads, SEMIF_MODEL_DIR=str(folder / "no-model-dir"))
    try:
        code = batch.main(["local", str(folder / "in.jsonl"), "-o", str(folder / "out.jsonl"), "--model", str(model_path),
                           "--no-progress"])
    finally:
        for key, value in old.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    assert code == 0
    return folder, [json.loads(r) if i not in BROKEN else None for i, r in enumerate(records)]


def test_local_run_answers_one_line_per_record_in_order_with_broken_lines_as_error_objects(batch_files):
    folder, records = batch_files
    out = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    assert len(out) == len(records) == 29 + len(BROKEN)
    assert out[3]["error"]["code"] == "invalid_json"
    assert out[7]["error"]["field"].startswith("decision.options") and out[7]["id"] == "one-option"
    assert out[12]["error"]["code"] == "unknown_body_shape"
    assert out[20]["detail"][0]["loc"][:3] == ["body", "questions", "q"] and out[20]["id"] == "s1-bad"
    for record, answer in zip(records, out):
        if record is not None:
            assert answer["option_ids"] == [o["id"] for o in record["decision"]["options"]]


def test_every_good_line_equals_the_single_request_answer_computed_for_real(batch_files, model_path):
    from semif.serving.http.app import create_app
    from semif.serving.engine.context import Engine

    folder, records = batch_files
    out = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    # The reference: another engine with neither prefix cache nor logits memo, one JSON request per record.
    reference = Engine(model_path, n_ctx=4096, n_batch=512, n_threads=os.cpu_count() or 2, prefix_cache=False)
    try:
        with TestClient(create_app(make_settings(model_path), reference)) as client:
            compared = 0
            for record, answer in zip(records, out):
                if record is None:
                    continue
                single = client.post("/invocations", json=record)
                assert single.status_code == 200, single.text
                expected = single.json()
                assert expected["prompt"]["evaluated_tokens"] > 0  # evaluated, not remembered
                assert comparable(answer) == comparable(expected)
                compared += 1
    finally:
        reference.close()
    assert compared == 29


def test_report_counts_errors_choices_and_margins_and_scores_the_labels_with_semif_evals_code(batch_files):
    from semif.tools import batch

    folder, records = batch_files
    report_dir = folder / "report"
    assert batch.main(["report", str(folder / "out.jsonl"), "--input", str(folder / "labels.jsonl"),
                       "--out", str(report_dir)]) == 0
    report = json.loads((report_dir / "report.json").read_text())
    out = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    answered = [(r, a) for r, a in zip(records, out) if r is not None]
    assert report["records"] == len(records) and report["answer_lines"] == 29 and report["error_lines"] == len(BROKEN)
    assert report["errors"] == {"invalid_json": 1, "invalid_request": 1, "unknown_body_shape": 1,
                                out[20]["detail"][0]["type"]: 1}
    per_decision = {}
    for _, answer in answered:
        per_decision.setdefault(answer["id"], {}).setdefault(answer["choice"], 0)
        per_decision[answer["id"]][answer["choice"]] += 1
    assert report["choices"] == {k: dict(sorted(v.items(), key=lambda kv: -kv[1])) for k, v in per_decision.items()}
    assert report["margin"]["n"] == 29
    # Label scoring reports each answer's label mass; this output has no policy, so no abstentions.
    assert report["label_mass"]["n"] == 29 and 0.0 < report["label_mass"]["mean"] <= 1.0
    assert report["abstain_share"] is None
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]
    correct = sum(answer["choice"] == row["answer"] for row, (_, answer) in zip(rows, answered))
    assert report["labeled"] == 29
    assert report["evaluation"]["accuracy"] == pytest.approx(correct / 29)
    assert report["evaluation"]["probabilities"]["ece"] is not None
    names = {Path(p).name for p in report["plots"]}
    assert {"margins.png", "labeled-reliability.png", "labeled-accuracy-coverage.png"} <= names
    assert "label_mass.png" in names and "labeled-latency.png" not in names  # label mass reported; no client latency in a batch
    assert all((report_dir / name).stat().st_size > 1000 for name in names)


def test_report_plots_a_label_mass_histogram_when_the_output_has_one(tmp_path):
    from semif.tools import batch

    lines = [{"id": "q", "option_ids": ["a", "b"], "probabilities": [0.7, 0.3], "choice": "a", "label_mass": 0.4 + i / 50}
             for i in range(10)]
    (tmp_path / "out.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert batch.main(["report", str(tmp_path / "out.jsonl"), "--out", str(tmp_path / "r")]) == 0
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["label_mass"]["n"] == 10 and report["margin"]["p50"] == pytest.approx(0.4)
    assert (tmp_path / "r" / "label_mass.png").is_file() and "evaluation" not in report


def test_report_refuses_an_input_that_does_not_line_up_with_the_output(tmp_path):
    from semif.tools import batch

    (tmp_path / "out.jsonl").write_text('{"error": {"code": "invalid_json"}}\n')
    (tmp_path / "in.jsonl").write_text("{}\n{}\n")
    assert batch.main(["report", str(tmp_path / "out.jsonl"), "--input", str(tmp_path / "in.jsonl"),
                       "--out", str(tmp_path / "r")]) == 2


def test_report_counts_system_one_and_openai_answers_per_question_and_their_error_shapes(tmp_path):
    from semif.tools import batch

    lines = [
        {"id": "t1", "model": "m", "answers": {
            "team": {"type": "choice", "choice": "Billing", "probabilities": {"Billing": 0.8, "Sales": 0.2}},
            "anger": {"type": "score", "score": 0.7, "legend": {"0": "calm", "1": "angry"},
                      "probabilities": {"0": 0.3, "1": 0.7}}}},
        {"id": "t2", "answers": [{"type": "predicate", "name": "refund", "probability": 0.9},
                                 {"type": "choice", "name": "team", "choice": "billing",
                                  "probabilities": [{"value": "billing", "probability": 0.55}, {"value": "sales", "probability": 0.45}]}]},
        {"detail": [{"loc": ["body", "state"], "msg": "Field required", "type": "missing"}], "id": "t3"},
        {"error": {"message": "…", "type": "invalid_request_error", "param": "questions", "code": "missing_required_parameter"}},
    ]
    (tmp_path / "out.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    report, decisions, _ = batch.build_report(tmp_path / "out.jsonl")
    assert report["errors"] == {"missing": 1, "missing_required_parameter": 1}
    assert report["choices"] == {"team": {"Billing": 1, "billing": 1}, "anger": {"angry": 1}, "refund": {"true": 1}}
    assert sorted(round(d.margin, 6) for d in decisions) == [0.1, 0.4, 0.6, 0.8]


def test_local_against_a_running_adapter_url_answers_every_record_in_order(start_serve, tmp_path):
    from semif.tools import batch

    server = start_serve()
    records = [json.dumps({"decision": {"id": "a", "state": "My VPN drops.", "question": "Which team?",
                                        "options": [{"id": "network"}, {"id": "hardware"}]}}),
               "not json",
               json.dumps({"id": "s1", "state": "Charged twice.", "questions": {"refund": {"type": "noul", "instructions": "Refund?"}}})]
    (tmp_path / "in.jsonl").write_text("\n".join(records) + "\n")
    assert batch.main(["local", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), "--url", server.base_url,
                       "--max-records-per-batch", "2", "--no-progress"]) == 0
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [line.get("id") for line in out] == ["a", None, "s1"]
    assert out[1]["error"]["code"] == "invalid_json" and 0.0 <= out[2]["answers"]["refund"]["noul"] <= 1.0
    mini_batches = [line for line in server.log_lines() if line.get("contract") == "jsonlines"]
    assert [(m["records"], m["answered"]) for m in mini_batches] == [(2, 1), (1, 1)]
