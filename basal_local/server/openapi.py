"""The OpenAPI 3.1 description of both dialects (`GET /openapi.json`) and a `/docs` page that renders it.

Written by hand from docs/PROTOCOL.md: the handlers take raw bytes (the dialects' own error bodies), so a schema
generated from their signatures would say nothing.
"""

from __future__ import annotations

from typing import Any

from .. import __version__

_TEXT = {"description": "text, or any JSON object/array (rendered by the text rule)",
         "anyOf": [{"type": "string"}, {"type": "object"}, {"type": "array"}]}
_QUESTION = {
    "type": "object", "required": ["type"],
    "properties": {
        "type": {"type": "string", "enum": ["choice", "noul", "score", "multi", "act"]},
        "instructions": _TEXT,
        "criteria": {"description": "choice: {key: description} (or [keys]); noul: {true?, false?}; "
                                    "score: [level, ...] lowest first",
                     "anyOf": [{"type": "object"}, {"type": "array"}]},
        "option_keys": {"type": "string", "enum": ["show", "hide"]},
    },
}
_USAGE = {"type": "object", "properties": {
    "input_tokens": {"type": "integer"}, "output_tokens": {"type": "integer"}, "questions": {"type": "integer"},
    "branches": {"type": "integer"}, "latency_ms": {"type": "number"}}}
_PROBS = {"type": "object", "additionalProperties": {"type": "number"}}
_ANSWER = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string"}, "choice": {"type": "string"}, "noul": {"type": "number"},
    "score": {"type": "number"}, "confidence": {"type": "number"}, "probabilities": _PROBS,
    "legend": {"type": "object"}}}
_DECISION_RESPONSE = {"type": "object", "required": ["model", "answers", "usage"], "properties": {
    "model": {"type": "string"}, "answers": {"type": "object", "additionalProperties": _ANSWER}, "usage": _USAGE}}
_ERROR = {"type": "object", "properties": {"error": {"type": "string"}, "code": {"type": "string"},
                                           "detail": {}}}
_HEADERS = {
    "x-request-id": {"schema": {"type": "string"}, "description": "the request's id (echoed when sent)"},
    "x-typesafe-request-id": {"schema": {"type": "string"}, "description": "the same id, for typesafe-sdk"},
}
_BUSY = {"description": "overloaded: more than --max-inflight requests (retry after the headers' delay)",
         "headers": {**_HEADERS, "Retry-After": {"schema": {"type": "integer"}},
                     "retry-after-ms": {"schema": {"type": "integer"}, "description": "jittered retry slot"}},
         "content": {"application/json": {"schema": _ERROR}}}


def _decision(summary: str, description: str, errors: dict[str, str], models: list[str]) -> dict[str, Any]:
    request = {"type": "object", "required": ["state", "questions"], "properties": {
        "model": {"type": "string", "description": "a served model or alias (jev-latest = the default)",
                  "examples": models},
        "state": _TEXT, "questions": {"type": "object", "additionalProperties": _QUESTION, "minProperties": 1},
        "facts": {"type": ["string", "null"], "enum": ["off", "auto", None]}}}
    responses: dict[str, Any] = {"200": {
        "description": "answers, keyed by question id",
        "headers": {**_HEADERS, "x-basal-queue-ms": {"schema": {"type": "string"}},
                    "x-basal-compute-ms": {"schema": {"type": "string"}},
                    "x-basal-batch-requests": {"schema": {"type": "string"}},
                    "x-basal-cached-tokens": {"schema": {"type": "string"}}},
        "content": {"application/json": {"schema": _DECISION_RESPONSE}}}}
    for code, text in errors.items():
        responses[code] = {"description": text, "headers": _HEADERS,
                           "content": {"application/json": {"schema": _ERROR}}}
    responses["503"] = {"description": "models still loading (Retry-After)", "headers": _HEADERS}
    responses["529"] = _BUSY
    return {"post": {"summary": summary, "description": description, "requestBody": {
        "required": True, "description": "JSON; Content-Encoding zstd or gzip accepted",
        "content": {"application/json": {"schema": request, "example": {
            "model": models[0], "state": "The parcel arrived broken.",
            "questions": {"urgent": {"type": "noul", "instructions": "Is this urgent?"}}}}}},
        "responses": responses}}


def openapi_document(models: list[str]) -> dict[str, Any]:
    """The document for the models being served (their names appear as examples)."""
    simple = {"description": "ok", "headers": _HEADERS, "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "basal-local", "version": __version__,
                 "description": "Basal typed-decision models on localhost: the TypeSafe System One dialect "
                                "(/v1/systemone) and the upstream Basal dialect (/v1/basal)."},
        "paths": {
            "/v1/systemone": _decision(
                "Decide (TypeSafe System One dialect)",
                "Strict TypeSafe schema; errors are TypeSafe's (422 with a detail list, 400 usage errors).",
                {"400": "usage error (unknown model, too many options, ...)", "422": "validation error"}, models),
            "/v1/basal": _decision(
                "Decide (upstream Basal dialect)",
                "Upstream Server.decide: lenient; errors are 422 {\"error\": ...}; model may be omitted.",
                {"422": "invalid request"}, models),
            "/v1/models": {"get": {"summary": "Served models (name, description, release_date)",
                                   "responses": {"200": simple}}},
            "/health": {"get": {"summary": "ok / loading (503) / error (503)", "responses": {"200": simple}}},
            "/api/stats": {"get": {"summary": "queue, batches, prefix trees, per-request timings",
                                   "responses": {"200": simple}}},
            "/api/ps": {"get": {"summary": "models with their state, replicas and memory", "responses": {"200": simple}}},
            "/api/load": {"post": {"summary": "load a model: {model, keep_alive?, wait?} (200 loaded, 202 loading)",
                                   "responses": {"200": simple}}},
            "/api/unload": {"post": {"summary": "unload a model: {model, wait?}", "responses": {"200": simple}}},
            "/metrics": {"get": {"summary": "Prometheus text (only with serve --metrics)",
                                 "responses": {"200": {"description": "text format 0.0.4"}}}},
        },
    }


DOCS_HTML = """<!doctype html>
<html><head><meta charset="utf-8"><title>basal-local API</title>
<style>body{font-family:system-ui,sans-serif;max-width:60em;margin:2em auto;padding:0 1em}
code,pre{background:#f4f4f4;padding:.1em .3em}h2{margin-top:1.5em}</style></head>
<body><h1>basal-local API</h1>
<p>The machine-readable description is <a href="/openapi.json">/openapi.json</a> (OpenAPI 3.1); load it into any
OpenAPI viewer. The endpoints:</p>
<div id="paths">loading /openapi.json ...</div>
<script>
fetch('/openapi.json').then(r => r.json()).then(doc => {
  const out = [];
  for (const [path, ops] of Object.entries(doc.paths)) {
    for (const [method, op] of Object.entries(ops)) {
      out.push('<h2><code>' + method.toUpperCase() + ' ' + path + '</code></h2><p>' + (op.summary || '') +
               '</p>' + (op.description ? '<p>' + op.description + '</p>' : ''));
      const ex = op.requestBody && op.requestBody.content['application/json'].example;
      if (ex) out.push('<pre>' + JSON.stringify(ex, null, 2) + '</pre>');
      out.push('<p>responses: ' + Object.keys(op.responses).join(', ') + '</p>');
    }
  }
  document.getElementById('paths').innerHTML = out.join('');
});
</script></body></html>
"""
