"""Fields and types that would change an answer are refused by name on both dialects (never ignored), the exact
unknown-model message, and the per-request limits on questions and prompts (api/refusals.py)."""

import json

import pytest

from basal_local.api.refusals import MAX_PROMPTS, MAX_QUESTIONS

M = "basal-test-tiny"
NOUL = {"type": "noul", "instructions": "Is it late?"}
MULTI = {"type": "multi", "instructions": "Which apply?", "criteria": ["late", "broken"]}


def post(client, body, path):
    resp = client.post(path, content=json.dumps(body))
    return resp.status_code, resp.json()


def unsupported(loc, msg):
    return {"error": "unsupported", "detail": [{"type": "unsupported_feature", "loc": loc, "msg": msg}]}


TEXT_ONLY = "basal models read text only"
REFUSED_TOP = [
    ("assets", {"img": {"type": "image", "format": "png", "data_base64": "iVBORw0KGgo="}},
     f"images (assets) are not supported: {TEXT_ONLY}"),
    ("media", [{"type": "image", "data": "iVBORw0KGgo="}], f"media inputs are not supported: {TEXT_ONLY}"),
    ("lang", "en", "lang is not supported: the prompt language follows the state and instructions (Polish iff "
                   "they contain a Polish letter)"),
]
SYSTEMONE_ONLY = "/v1/systemone"  # /v1/basal answers these (protocol/multi_objective.py, protocol/tools.py)
REFUSED_FIELDS = [
    (MULTI, "exclusive", ["late"], "multi exclusive labels are not supported on /v1/systemone (/v1/basal answers them)",
     SYSTEMONE_ONLY),
    (MULTI, "fallback", "late", "multi fallback is not supported on /v1/systemone (/v1/basal answers it)",
     SYSTEMONE_ONLY),
    (MULTI, "fallback_threshold", 0.3, "multi fallback_threshold is not supported on /v1/systemone (/v1/basal "
     "answers it)", SYSTEMONE_ONLY),
    (MULTI, "objective", "f1", "multi objective is not supported on /v1/systemone (/v1/basal answers it)",
     SYSTEMONE_ONLY),
    (NOUL, "labels", {"true": "late", "false": "on time"},
     'noul labels are not supported: describe the outcomes in criteria {"true", "false"}', None),
]
REFUSED_TYPES = [("tool", "tool calls: /v1/basal answers them", SYSTEMONE_ONLY),
                 ("classify", "the 2.1 classify task", None), ("verify", "the 2.1 verify task", None),
                 ("compress", "the 2.1 compress task", None), ("extract", "the 2.1 extract task", None),
                 ("box", f"box questions ({TEXT_ONLY})", None)]
SUPPORTED = {"/v1/systemone": "choice, noul, score, multi, act", "/v1/basal": "choice, noul, score, multi, act, tool"}
PATHS = ["/v1/systemone", "/v1/basal"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("field, value, msg", REFUSED_TOP)
def test_top_level_fields_that_change_the_answer_are_refused(app_client, path, field, value, msg):
    body = {"model": M, "state": "The parcel is late.", "questions": {"q": NOUL}, field: value}
    assert post(app_client, body, path) == (422, unsupported(["body", field], msg))
    body[field] = None  # null is "not given"
    assert post(app_client, body, path)[0] == 200


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("question, field, value, msg, only", REFUSED_FIELDS)
def test_question_fields_that_change_the_answer_are_refused(app_client, path, question, field, value, msg, only):
    body = {"model": M, "state": "The parcel is late.", "questions": {"ok": NOUL, "q": {**question, field: value}}}
    if only in (None, path):
        assert post(app_client, body, path) == (422, unsupported(["body", "questions", "q", field], msg))
    else:  # answered there, never ignored: the answer says which objective it used
        status, out = post(app_client, body, path)
        assert status in (200, 422) and out.get("error") != "unsupported", out


@pytest.mark.parametrize("path, qtype, what", [(path, qtype, what) for path in PATHS
                                                for qtype, what, only in REFUSED_TYPES if only in (None, path)])
def test_question_types_the_engine_lacks_are_refused_by_name(app_client, path, qtype, what):
    body = {"model": M, "state": "s", "questions": {"t": {"type": qtype, "instructions": "i",
                                                          "criteria": {"a": "x", "b": "y"}}}}
    msg = f"question type '{qtype}' ({what}) is not supported by this runtime (supported: {SUPPORTED[path]})"
    assert post(app_client, body, path) == (422, unsupported(["body", "questions", "t"], msg))


def test_schema_and_usage_errors_still_come_first_on_systemone(app_client):
    body = {"model": M, "state": "s", "lang": "pl", "questions": {"a": {"type": "extract"}, "b": {"type": "choice"}}}
    status, out = post(app_client, body, "/v1/systemone")
    assert status == 422 and out["detail"][0]["type"] == "missing"
    body["questions"]["b"] = {"type": "rank"}
    assert post(app_client, body, "/v1/systemone") == (400, {"detail": {"error_type": "api_usage_error", "message":
                                                      'Invalid request. Unknown question type "rank" (choice, noul, '
                                                      'score): b'}})
    del body["questions"]["b"]  # then the top-level refusal before the question's
    assert post(app_client, body, "/v1/systemone")[1]["detail"][0]["loc"] == ["body", "lang"]


def test_basal_unknown_type_says_so_by_name(app_client):
    body = {"state": "s", "questions": {"t": {"type": "rank", "instructions": "i"}}}
    assert post(app_client, body, "/v1/basal") == (422, {"error": "question 't': unknown type 'rank' read as a "
                                                         "choice: 0 options (supported: 2..10; types: choice, noul, "
                                                         "score, multi, act, tool)"})


def test_fields_that_cannot_change_an_answer_are_still_ignored(app_client):
    """docs/WIRE.md's list: ids and gold labels of basal-run items, basal-client's `detail`, SDK extra keys."""
    body = {"model": M, "state": "The parcel is late.", "id": "x1", "gold": "a", "detail": "high",
            "early_exit": "off", "metadata": {"k": 1}, "questions": {"q": {**NOUL, "gold": "true", "id": 3}}}
    for path in PATHS:
        assert post(app_client, body, path)[0] == 200


def test_unknown_model_messages_are_exact_and_the_served_names_go_to_a_header(app_client):
    body = {"model": "nope-1", "state": "s", "questions": {"q": NOUL}}
    resp = app_client.post("/v1/systemone", content=json.dumps(body))
    assert (resp.status_code, resp.json()) == (400, {"detail": {"error_type": "api_usage_error",
                                                                "message": "Unknown model: nope-1"}})
    assert resp.headers["x-basal-served-models"] == M
    resp = app_client.post("/v1/basal", content=json.dumps(body))
    assert (resp.status_code, resp.json()) == (422, {"error": "Unknown model: nope-1"})
    assert resp.headers["x-basal-served-models"] == M


def many(n, question=NOUL):
    return {"model": M, "state": "s", "questions": {f"q{i}": question for i in range(n)}}


def test_question_limit_on_both_dialects(app_client):
    n = MAX_QUESTIONS + 1
    assert post(app_client, many(n), "/v1/systemone") == (400, {"detail": {
        "error_type": "api_usage_error",
        "message": f"Too many questions. Must have at most {MAX_QUESTIONS} questions per request (got {n})."}})
    assert post(app_client, many(n), "/v1/basal") == (422, {
        "error": f"too many questions: {n} (at most {MAX_QUESTIONS} per request)"})


def test_prompt_limit_on_both_dialects(app_client):
    # a multi costs two prompts per label; 5 questions of 1000 labels need 10,000
    labels = {"type": "multi", "instructions": "i", "criteria": [f"l{i}" for i in range(1000)]}
    body = many(5, labels)
    assert post(app_client, body, "/v1/systemone") == (400, {"detail": {
        "error_type": "api_usage_error",
        "message": f"Too many prompts. A request may need at most {MAX_PROMPTS} prompts (these questions need "
                   "10000)."}})
    assert post(app_client, body, "/v1/basal") == (422, {
        "error": f"too many prompts: these questions need 10000 (at most {MAX_PROMPTS} per request)"})


def test_prompts_are_counted_like_the_planner_builds_them():
    from basal_local.api.refusals import prompts_of

    assert prompts_of("noul", {}) == 2 and prompts_of("choice", {"criteria": {"a": 1, "b": 2, "c": 3}}) == 2
    assert prompts_of("multi", {"criteria": ["a", "b", "c"]}) == 6
    assert prompts_of("choice", {"criteria": [str(i) for i in range(11)]}) == 6  # docs/PROTOCOL.md §6.7: 4 + 2
    assert prompts_of("score", {"levels": ["a", "b"]}) == 2


def test_health_without_the_key_says_only_the_status():
    """With --api-key: a probe without credentials learns ok/loading and nothing else (security.py)."""
    from litestar.testing import TestClient

    from basal_local.server.app import AppState, create_app
    from basal_local.server.security import AccessPolicy, Guard

    state = AppState()
    app = create_app(state)
    with TestClient(Guard(app, AccessPolicy.build("127.0.0.1", "k3y", hosts=["testserver.local"]))) as client:
        r = client.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "loading"})
        state.ready = True
        assert (client.get("/health").status_code, client.get("/health").json()) == (200, {"status": "ok"})
        r = client.get("/health", headers={"authorization": "Bearer k3y"})
        assert r.status_code == 200 and set(r.json()) > {"status", "version", "models"}
        assert client.get("/api/stats").status_code == 401  # only /health is open
        assert client.post("/health").status_code == 401


def test_a_small_request_is_answered_while_a_huge_legal_one_is_planned(daemon):
    """30.8: the largest legal request (1,024 questions, 2,048 distinct prompts, ~0.5 MB) is planned in its own pool
    and run in the long lane; a small request sent meanwhile is answered before it."""
    import threading

    from .conftest import http

    _, _, health = http("GET", daemon.url + "/health")
    model = health["models"][0]
    filler = "the parcel came late and the box was wet " * 10
    huge = {"model": model, "state": "Order 77 arrived late.", "questions": {
        f"q{i}": {"type": "noul", "instructions": f"Question {i}: {filler}?"} for i in range(MAX_QUESTIONS)}}
    small = {"model": model, "state": "Order 78.", "questions": {"q": NOUL}}
    done: list[str] = []
    statuses: dict[str, int] = {}

    def send(name, body):
        statuses[name] = http("POST", daemon.url + "/v1/systemone", body, timeout=300)[0]
        done.append(name)

    big = threading.Thread(target=send, args=("huge", huge))
    big.start()
    while not done:  # wait until the huge one is admitted (parsed; now planning or queued), not a fixed sleep
        _, _, stats = http("GET", daemon.url + "/api/stats")
        if stats["admission"]["inflight"] >= 1:
            break
    send("small", small)
    big.join(300)
    assert statuses == {"huge": 200, "small": 200}
    assert done == ["small", "huge"]
