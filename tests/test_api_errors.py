"""Every row of docs/PROTOCOL.md §2.1 and every `/v1/basal` error (§8) as a request: exact status and body."""

import json

import pytest

from basal_local import __version__

M = "basal-test-tiny"
UNION = [("string_type", "str", "Input should be a valid string"),
         ("dict_type", "dict[any,any]", "Input should be a valid dictionary"),
         ("list_type", "list[any]", "Input should be a valid list")]


def union(loc, value):
    return [{"type": t, "loc": [*loc, s], "msg": m, "input": value} for t, s, m in UNION]


def post(client, body, path="/v1/systemone", headers=None):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    resp = client.post(path, content=data, headers=headers or {})
    return resp.status_code, resp.json()


def q(**fields):
    return {"model": M, "state": "s", "questions": {"q": fields}}


CASES = [
    # body not JSON: offset and the decoder's message
    ('{"model": "x",}', 422, {"detail": [{"type": "json_invalid", "loc": ["body", 14], "msg": "JSON decode error",
                                          "input": {}, "ctx": {"error": "Expecting property name enclosed in double quotes"}}]}),
    ("", 422, {"detail": [{"type": "json_invalid", "loc": ["body", 0], "msg": "JSON decode error", "input": {},
                           "ctx": {"error": "Expecting value"}}]}),
    ('{"a": NaN}', 422, {"detail": [{"type": "json_invalid", "loc": ["body", 6], "msg": "JSON decode error",
                                     "input": {}, "ctx": {"error": "Expecting value"}}]}),
    ([1, 2], 422, {"detail": [{"type": "model_attributes_type", "loc": ["body"],
                               "msg": "Input should be a valid dictionary or object to extract fields from", "input": [1, 2]}]}),
    ({"state": "s", "questions": {"q": {"type": "noul", "instructions": "i"}}}, 422,
     {"detail": [{"type": "missing", "loc": ["body", "model"], "msg": "Field required",
                  "input": {"state": "s", "questions": {"q": {"type": "noul", "instructions": "i"}}}}]}),
    ({"model": M, "state": None, "questions": {"q": {"type": "noul", "instructions": "i"}}}, 422,
     {"detail": [{"type": "missing", "loc": ["body", "state"], "msg": "Field required",
                  "input": {"model": M, "state": None, "questions": {"q": {"type": "noul", "instructions": "i"}}}}]}),
    ({"model": 7, "state": True, "questions": {}}, 422,
     {"detail": [{"type": "string_type", "loc": ["body", "model"], "msg": "Input should be a valid string", "input": 7},
                 *union(["body", "state"], True),
                 {"type": "too_short", "loc": ["body", "questions"],
                  "msg": "Dictionary should have at least 1 item after validation, not 0", "input": {},
                  "ctx": {"field_type": "Dictionary", "min_length": 1, "actual_length": 0}}]}),
    ({"model": M, "state": "s", "questions": []}, 422,
     {"detail": [{"type": "dict_type", "loc": ["body", "questions"], "msg": "Input should be a valid dictionary",
                  "input": []}]}),
    ({"model": M, "state": "s"}, 422,
     {"detail": [{"type": "missing", "loc": ["body", "questions"], "msg": "Field required",
                  "input": {"model": M, "state": "s"}}]}),
    ({"model": M, "state": "s", "questions": {"q": 5}}, 422,
     {"detail": [{"type": "model_attributes_type", "loc": ["body", "questions", "q"],
                  "msg": "Input should be a valid dictionary or object to extract fields from", "input": 5}]}),
    (q(instructions="i"), 422,
     {"detail": [{"type": "union_tag_not_found", "loc": ["body", "questions", "q"],
                  "msg": "Unable to extract tag using discriminator 'type'", "input": {"instructions": "i"},
                  "ctx": {"discriminator": "'type'"}}]}),
    (q(type="score", criteria=[]), 422,
     {"detail": [{"type": "too_short", "loc": ["body", "questions", "q", "score", "criteria"],
                  "msg": "List should have at least 1 item after validation, not 0", "input": [],
                  "ctx": {"field_type": "List", "min_length": 1, "actual_length": 0}}]}),
    (q(type="score", criteria="abc"), 422,
     {"detail": [{"type": "list_type", "loc": ["body", "questions", "q", "score", "criteria"],
                  "msg": "Input should be a valid list", "input": "abc"}]}),
    (q(type="score", criteria=["a", None]), 422, {"detail": union(["body", "questions", "q", "score", "criteria", 1], None)}),
    (q(type="choice", criteria={"a": "x"}, option_keys="maybe"), 422,
     {"detail": [{"type": "literal_error", "loc": ["body", "questions", "q", "choice", "option_keys"],
                  "msg": 'option_keys must be "show" or "hide"', "input": "maybe"}]}),
    ({"model": M, "state": "s", "facts": "on", "questions": {"q": {"type": "noul", "instructions": "i"}}}, 422,
     {"detail": [{"type": "literal_error", "loc": ["body", "facts"], "msg": 'facts must be "off" or "auto"',
                  "input": "on"}]}),
    (q(type="multi", criteria=["a"], evidence=True), 422,
     {"detail": [{"type": "value_error", "loc": ["body", "questions", "q", "evidence"],
                  "msg": "evidence is not supported for multi", "input": True}]}),
    (q(type="choice"), 422,
     {"detail": [{"type": "missing", "loc": ["body", "questions", "q", "choice", "criteria"], "msg": "Field required",
                  "input": {"type": "choice"}}]}),
    (q(type="choice", criteria="a"), 422,
     {"detail": [{"type": "dict_type", "loc": ["body", "questions", "q", "choice", "criteria"],
                  "msg": "Input should be a valid dictionary", "input": "a"}]}),
    (q(type="choice", criteria=["a", 3]), 422,
     {"detail": [{"type": "string_type", "loc": ["body", "questions", "q", "choice", "criteria", 1],
                  "msg": "Input should be a valid string", "input": 3}]}),
    (q(type="choice", criteria={"a": 1.5}, instructions=False), 422,
     {"detail": [*union(["body", "questions", "q", "choice", "instructions"], False),
                 *union(["body", "questions", "q", "choice", "criteria", "a"], 1.5)]}),
    (q(type="noul", criteria="yes"), 422,
     {"detail": [{"type": "model_type", "loc": ["body", "questions", "q", "noul", "criteria"],
                  "msg": "Input should be a valid dictionary or instance of NoulCriteria", "input": "yes",
                  "ctx": {"class_name": "NoulCriteria"}}]}),
    (q(type="noul", criteria={"true": 1}), 422, {"detail": union(["body", "questions", "q", "noul", "criteria", "true"], 1)}),
    # usage errors (400), only without schema errors
    (q(type="rank"), 400, {"detail": {"error_type": "api_usage_error",
                                      "message": 'Invalid request. Unknown question type "rank" (choice, noul, score): q'}}),
    (q(type=5), 400, {"detail": {"error_type": "api_usage_error",
                                 "message": "Invalid request. Question type 5 is not a string: q"}}),
    (q(type="choice", criteria={}), 400, {"detail": {"error_type": "api_usage_error",
                                                     "message": "Choice question must have at least one choice: q"}}),
    (q(type="choice", criteria=[str(i) for i in range(256)]), 400,
     {"detail": {"error_type": "api_usage_error", "message": "Too many choices. Must have at most 255 choices."}}),
    (q(type="score", criteria=[str(i) for i in range(11)]), 400,
     {"detail": {"error_type": "api_usage_error", "message": "Too many score levels. Must have at most 10 levels."}}),
    (q(type="noul"), 400, {"detail": {"error_type": "api_usage_error",
                                      "message": "Noul question must have criteria or instructions: q"}}),
    ({"model": "nope-1", "state": "s", "questions": {"q": {"type": "noul"}}}, 400,
     {"detail": {"error_type": "api_usage_error", "message": "Unknown model: nope-1"}}),
    # unsupported (valid, but not answerable by this runtime)
    (q(type="choice", criteria=[str(i) for i in range(11)], evidence=True), 422,
     {"error": "unsupported", "detail": [{"type": "unsupported_feature", "loc": ["body", "questions", "q"],
                                          "msg": "evidence needs 2 to 10 options"}]}),
    (q(type="act", criteria={"a": "x"}, costs={"wrong": 1}), 422,
     {"error": "unsupported", "detail": [{"type": "unsupported_single_option", "loc": ["body", "questions", "q"],
                                          "msg": "act questions need at least 2 outcomes (got 1)"}]}),
    (q(type="act", criteria=[str(i) for i in range(11)], costs={"wrong": 1}), 422,
     {"error": "unsupported", "detail": [{"type": "unsupported_option_count", "loc": ["body", "questions", "q"],
                                          "msg": "act questions support at most 10 outcomes (got 11)"}]}),
    # act and multi schema errors
    (q(type="act", instructions="i"), 422,
     {"detail": [{"type": "missing", "loc": ["body", "questions", "q", "act", "costs"], "msg": "Field required",
                  "input": {"type": "act", "instructions": "i"}}]}),
    (q(type="act", criteria={"a": 1, "b": 2}, base="rank", costs={"wrong": 1}), 422,
     {"detail": [{"type": "literal_error", "loc": ["body", "questions", "q", "act", "base"],
                  "msg": "unsupported act base 'rank' (noul, choice or score)", "input": "rank"}]}),
    (q(type="act", instructions="i", costs={"approve": {"true": 0}, "reject": {"true": 1, "false": 0}}), 422,
     {"detail": [{"type": "value_error", "loc": ["body", "questions", "q", "act", "costs"],
                  "msg": """costs["approve"] must give a cost for every outcome ['true', 'false']""",
                  "input": {"approve": {"true": 0}, "reject": {"true": 1, "false": 0}}}]}),
    (q(type="multi", criteria=["a", 1], threshold="x"), 422,
     {"detail": [{"type": "string_type", "loc": ["body", "questions", "q", "multi", "criteria", 1],
                  "msg": "Input should be a valid string", "input": 1},
                 {"type": "float_type", "loc": ["body", "questions", "q", "multi", "threshold"],
                  "msg": "Input should be a valid number", "input": "x"}]}),
    (q(type="multi", criteria=[]), 400, {"detail": {"error_type": "api_usage_error",
                                                    "message": "Multi question must have at least one label: q"}}),
]


@pytest.mark.parametrize("body, status, expected", CASES)
def test_systemone_error_table(app_client, body, status, expected):
    assert post(app_client, body) == (status, expected)


def test_schema_errors_win_over_usage_errors_and_only_first_usage(app_client):
    body = {"model": M, "state": "s", "questions": {"a": {"type": "rank"}, "b": {"type": "choice"}}}
    status, out = post(app_client, body)
    assert status == 422 and out["detail"][0]["loc"] == ["body", "questions", "b", "choice", "criteria"]
    body = {"model": M, "state": "s", "questions": {"a": {"type": "rank"}, "b": {"type": "choice", "criteria": {}}}}
    assert post(app_client, body)[1]["detail"]["message"].endswith(": a")


def test_unknown_fields_ignored_and_single_option_shortcut(app_client):
    body = {"model": M, "state": "s", "id": "x", "gold": {},
            "questions": {"c": {"type": "choice", "criteria": {"only": "x"}, "extra": 1},
                          "s": {"type": "score", "criteria": ["one"]}}}
    status, out = post(app_client, body)
    assert status == 200
    assert out["answers"] == {
        "c": {"type": "choice", "choice": "only", "probabilities": {"only": 1.0}, "confidence": 1.0},
        "s": {"type": "score", "score": 0.0, "legend": {"0": "one"}, "probabilities": {"0": 1.0}, "confidence": 1.0}}
    assert out["usage"]["input_tokens"] == 0 and out["usage"]["branches"] == 0 and out["usage"]["questions"] == 2


def test_act_refusal_without_defer_action(app_client):
    """max_error with a certified threshold above any 2-option confidence of a random model and no defer action."""
    body = q(type="act", instructions="i", costs={"a": {"true": 0, "false": 1}, "b": {"true": 1, "false": 0}},
             max_error=0.01)
    status, out = post(app_client, body)
    assert (status, out) == (422, {"detail": [{"type": "value_error", "loc": ["body", "questions", "q"],
                                               "msg": 'max_error needs a defer action ("defer"/"human" or '
                                                      'defer_action)'}]})
    status, out = post(app_client, body, "/v1/basal")
    assert (status, out) == (422, {"error": 'question \'q\': max_error needs a defer action ("defer"/"human" or '
                                            'defer_action)'})
    body["questions"]["q"]["costs"]["human"] = {"true": 5, "false": 5}
    status, out = post(app_client, body)
    assert status == 200 and out["answers"]["q"]["action"] == "human" and out["answers"]["q"]["refused"] in "ab"


def test_context_length_exceeded(app_client):
    body = {"model": M, "state": "słowo " * 3000, "questions": {"q": {"type": "noul", "instructions": "i"}}}
    status, out = post(app_client, body)
    assert status == 422 and out["error"] == "unsupported"
    item = out["detail"][0]
    assert item["type"] == "context_length_exceeded" and item["loc"] == ["body", "questions", "q"]
    assert item["msg"].startswith("the prompt has ") and "maximum context length of 4096 tokens of model" in item["msg"]


BASAL_CASES = [
    ("{", 422, {"error": "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"}),
    ("[1]", 422, {"error": "request body must be a JSON object"}),
    ({"questions": {}}, 422, {"error": "'state'"}),
    ({"state": "s", "questions": {"q": {"type": "choice", "criteria": {"a": "x"}}}}, 422,
     {"error": "question 'q': 1 options (supported: 2..10)"}),
    ({"state": "s", "questions": {"q": {"criteria": ["a"]}, "r": {"type": "score", "criteria": [str(i) for i in range(11)]}}},
     422, {"error": "question 'q': 1 options (supported: 2..10); question 'r': 11 options (supported: 2..10)"}),
    ({"model": "nope-1", "state": "s", "questions": {}}, 422, {"error": "Unknown model: nope-1"}),
    ({"state": "s", "questions": {"q": {"type": "choice", "criteria": ["a", "b"], "option_keys": "x"}}}, 422,
     {"error": "option_keys must be 'show' or 'hide', got x"}),
    ({"state": "s", "questions": {"q": {"type": "multi", "criteria": []}}}, 422,
     {"error": "question 'q': multi needs at least one label in criteria"}),
    ({"state": "s", "questions": {"q": {"type": "act", "instructions": "i"}}}, 422,
     {"error": "question 'q': costs: Field required"}),
    ({"state": "s", "questions": {"q": {"type": "act", "criteria": ["a"], "costs": {"wrong": 1}}}}, 422,
     {"error": "question 'q': 1 options (supported: 2..10)"}),
]


@pytest.mark.parametrize("body, status, expected", BASAL_CASES)
def test_basal_errors(app_client, body, status, expected):
    assert post(app_client, body, "/v1/basal") == (status, expected)


def test_basal_lenient_unknown_type_is_uncalibrated_choice(app_client):
    """docs/PROTOCOL.md §5/§8: an unknown type is read as choice with T = 1; a choice question gets T_choice.

    Both questions render the same prompts (one readout in the packed batch), so the choice answer must be
    the unknown-type probabilities calibrated here with the model's T_choice (docs/PROTOCOL.md §5, §7)."""
    import math

    t_choice = 1.1387886347566916  # CALIBRATION.json of the generated model (the basal-1.5-mini value)
    criteria = {"a": "Uszkodzenie", "b": "Opóźnienie", "c": "Inne"}
    body = {"state": "Paczka dotarła uszkodzona.", "questions": {
        "u": {"type": "weird", "instructions": "Rodzaj?", "criteria": criteria},
        "c": {"type": "choice", "instructions": "Rodzaj?", "criteria": criteria}}}
    status, out = post(app_client, body, "/v1/basal")
    assert status == 200
    unknown, choice = out["answers"]["u"], out["answers"]["c"]
    p = [unknown["probabilities"][k] for k in criteria]
    z = [math.log(max(v, 1e-12)) / t_choice for v in p]
    e = [math.exp(v - max(z)) for v in z]
    calibrated = [v / sum(e) for v in e]
    assert max(abs(choice["probabilities"][k] - v) for k, v in zip(criteria, calibrated)) <= 1e-12
    assert max(abs(a - b) for a, b in zip(p, calibrated)) > 1e-4  # calibration visibly changes them
    best = max(range(3), key=lambda i: (p[i], -i))
    assert unknown == {"type": "choice", "choice": list(criteria)[best],
                       "probabilities": dict(zip(criteria, p)), "confidence": max(p)}
    assert abs(sum(p) - 1.0) <= 1e-12


def test_zstd_body_and_unknown_encoding(app_client):
    import zstandard

    body = json.dumps(q(type="noul", instructions="i")).encode()
    resp = app_client.post("/v1/systemone", content=zstandard.ZstdCompressor().compress(body),
                           headers={"content-encoding": "zstd"})
    assert resp.status_code == 200 and resp.json()["answers"]["q"]["type"] == "noul"
    resp = app_client.post("/v1/systemone", content=body, headers={"content-encoding": "br"})
    assert resp.status_code == 415


def test_overload_529_then_recovery(app_client):
    state = app_client.basal_state
    state.max_inflight, saved = 0, state.max_inflight
    try:
        resp = app_client.post("/v1/systemone", content=json.dumps(q(type="noul", instructions="i")))
        assert resp.status_code == 529 and resp.headers["retry-after"] == "1"
        assert resp.json() == {"detail": {"error_type": "overloaded_error",
                                          "message": "Too many requests in flight. Retry after a short delay."}}
        resp = app_client.post("/v1/basal", content=json.dumps(q(type="noul", instructions="i")))
        assert (resp.status_code, resp.json()) == (529, {"error": "overloaded: too many requests in flight"})
    finally:
        state.max_inflight = saved
    assert post(app_client, q(type="noul", instructions="i"))[0] == 200


def test_loading_state_answers_503(app_client):
    state = app_client.basal_state
    state.ready = False
    try:
        resp = app_client.get("/health")
        assert (resp.status_code, resp.json()) == (503, {"status": "loading", "version": __version__})
        resp = app_client.post("/v1/systemone", content=json.dumps(q(type="noul", instructions="i")))
        assert resp.status_code == 503 and resp.headers["retry-after"] == "5"
    finally:
        state.ready = True
    assert app_client.get("/health").status_code == 200


def test_settings_flags_over_env_over_config_file(tmp_path, monkeypatch):
    from basal_local.server.settings import Settings

    config = tmp_path / "config.toml"
    config.write_text('port = 9001\nhost = "127.0.0.2"\nmax_batch_tokens = 4096\nschedule = "fifo"\n'
                      'long_tokens = 0\nmodels = ["a"]\n')
    monkeypatch.setenv("BASAL_LOCAL_PORT", "9002")
    s = Settings.load({"host": None, "long_slice_ms": 50}, config)
    assert (s.port, s.host, s.models) == (9002, "127.0.0.2", ["a"])
    assert (s.engine.max_batch_tokens, s.engine.schedule, s.engine.long_tokens, s.engine.long_slice_ms) == \
        (4096, "fifo", 0, 50.0)
    assert Settings.load({"port": 9003}, config).port == 9003
    config.write_text("typo_setting = 1\n")
    with pytest.raises(ValueError, match="unknown setting 'typo_setting'"):
        Settings.load({}, config)
