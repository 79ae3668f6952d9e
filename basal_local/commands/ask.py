"""`basal-local ask`: one decision through a running daemon, shown as a probability bar chart."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from . import UserError, auth_headers, get_json, key_refused
from .serving import client_key, daemon_url

BAR = 32
MAX_OPTIONS = 10  # /v1/basal: one letter A-J per option
LOAD_WAIT_S = 900.0  # a model the daemon loads on this request: how long to wait for it


def read_state(text: str) -> str:
    """--state TEXT, @FILE, or @- for standard input."""
    if not text.startswith("@"):
        return text
    if text == "@-":
        try:
            return sys.stdin.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--state @-: cannot read standard input ({exc.__class__.__name__})",
                            "pipe UTF-8 text into basal-local ask, or give --state the text itself") from None
    path = Path(text[1:]).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--state {text}: cannot read {path} ({exc.__class__.__name__})",
                        "give --state the text itself, or @FILE naming a readable UTF-8 file") from None


def build_question(args: argparse.Namespace) -> dict[str, Any]:
    asked = next(text for text in (args.noul, args.choice, args.score) if text is not None)
    if not asked.strip():
        raise UserError("the question is empty", 'ask something, e.g. --noul "Is this urgent?"')
    if args.noul is not None:
        if args.option or args.level:
            raise UserError("--noul takes no -o/-l", "drop the options, or ask --choice/--score instead")
        return {"type": "noul", "instructions": args.noul}
    if args.choice is not None:
        if len(args.option) < 2:
            raise UserError("--choice needs at least two options", 'add them: -o refund="Wants a refund" -o other')
        criteria: dict[str, Any] = {}
        for item in args.option:
            key, sep, desc = item.partition("=")
            if not key.strip():
                raise UserError(f"-o {item!r} has no key", "write -o KEY=DESCRIPTION (or just -o KEY)")
            if key.strip() in criteria:
                raise UserError(f"-o {item!r}: the key {key.strip()!r} is given twice", "give each option its own key")
            criteria[key.strip()] = desc if sep else key.strip()
        return {"type": "choice", "instructions": args.choice, "criteria": criteria}
    if len(args.level) < 2:
        raise UserError("--score needs at least two levels", "add them lowest first: -l low -l medium -l high")
    return {"type": "score", "instructions": args.score, "criteria": list(args.level)}


def post(url: str, path: str, body: dict[str, Any], timeout: float = 120.0,
         api_key: str | None = None) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of a POST; connection failures are UserErrors naming the daemon."""
    req = urllib.request.Request(url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **auth_headers(api_key)})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read())
        except ValueError:
            return err.code, {"error": err.reason}
    except (urllib.error.URLError, OSError) as exc:
        raise UserError(f"cannot reach a daemon at {url} ({getattr(exc, 'reason', exc)})",
                        "start one with `basal-local serve`, or point --url at the right address") from None


def error_text(body: dict[str, Any]) -> str:
    detail = body.get("detail")
    if isinstance(body.get("error"), str):
        return body["error"]
    if isinstance(detail, dict) and "message" in detail:
        return str(detail["message"])
    if isinstance(detail, list):
        return "; ".join(".".join(str(p) for p in d.get("loc", [])[1:]) + ": " + str(d.get("msg")) for d in detail)
    return json.dumps(body)[:200]


def chart(question: str, answer: dict[str, Any], color: bool, dialect: str = "basal") -> str:
    """The answer as one headline and a bar per option, highest probability marked.

    The headline gives the answer's own probability as `p`. Both dialects also send a `confidence`: on /v1/basal it
    is that same largest p (so it is not repeated); on /v1/systemone it is TypeSafe's formula, a different number,
    printed under its own name with what it measures."""
    probs: dict[str, float] = answer.get("probabilities") or {}
    kind = answer.get("type")
    top = max(probs.values()) if probs else None
    if kind == "noul":
        verdict = "yes" if answer["noul"] >= 0.5 else "no"
        head = f"{verdict}  (p(true) = {answer['noul']:.3f})"
    elif kind == "score":
        legend = answer.get("legend") or {}
        probs = {f"{k} {legend.get(k, '')}".strip(): v for k, v in probs.items()}
        best = max(probs, key=probs.get) if probs else None
        head = f"score {answer['score']:.2f}" + (f"  (most likely {best}, p = {top:.3f})" if best else "")
    else:
        head = f"{answer.get('choice')}" + (f"  (p = {top:.3f})" if top is not None else "")
    if dialect == "systemone" and "confidence" in answer and kind in ("choice", "score"):
        what = "(p - 1/n) / (1 - 1/n)" if kind == "choice" else "1 - spread around the most likely level"
        head += f"\n    TypeSafe confidence {answer['confidence']:.3f} = {what}"
    lines = [f"{question}\n  → {head}"]
    width = max((len(k) for k in probs), default=0)
    best = max(probs, key=probs.get) if probs else None
    for key, p in probs.items():
        filled = int(round(p * BAR))
        bar = "█" * filled + "░" * (BAR - filled)
        if color:
            tint = "\033[32m" if key == best else "\033[2m"
            bar = f"{tint}{'█' * filled}\033[0m\033[2m{'░' * (BAR - filled)}\033[0m"
        lines.append(f"  {key:<{width}}  {bar}  {p:6.3f}")
    return "\n".join(lines)


def refusal(url: str, status: int, answer: dict[str, Any], api_key: str | None) -> UserError:
    """The daemon's refusal as two lines whose second fits the cause."""
    text = error_text(answer)
    if status == 401:
        return key_refused(url, api_key)
    if status == 503:
        return UserError(f"the daemon at {url} is not ready: {text}",
                         "wait for `ready:` in its output (`basal-local ps` shows it), then ask again", status=1)
    if text.lower().startswith("unknown model"):
        return UserError(f"the daemon answered {status}: {text}",
                         "name a served model with --model (`basal-local ps` lists them), or drop --model", status=1)
    if status in (404, 405):
        return UserError(f"the daemon answered {status}: {text}",
                         "give --url the daemon's root address, e.g. http://127.0.0.1:8000", status=1)
    return UserError(f"the daemon answered {status}: {text}",
                     "check the question and options (`basal-local ask -h`)", status=1)


def ask_command(args: argparse.Namespace) -> int:

    url = daemon_url(args)
    key = client_key(args)
    question = build_question(args)
    body: dict[str, Any] = {"state": read_state(args.state), "questions": {"q": question}}
    path = "/v1/basal"
    if len(question.get("criteria") or ()) > MAX_OPTIONS:
        # /v1/basal stops at 10 options (one letter each); /v1/systemone runs a large choice in rounds
        path = "/v1/systemone"
        body["model"] = args.model or get_json(url, "/health", api_key=key).get("default_model")
    if args.model:
        body["model"] = args.model
    status, answer = post(url, path, body, api_key=key)
    started, said = time.monotonic(), False
    while status == 503 and " is loading" in error_text(answer) and time.monotonic() - started < LOAD_WAIT_S:
        if not said:  # the daemon loads the model this request named (it was unloaded): wait for it
            print(f"basal-local: {error_text(answer).split(';')[0]}; waiting for it (Ctrl-C stops)",
                  file=sys.stderr, flush=True)
            said = True
        time.sleep(1.0)
        status, answer = post(url, path, body, api_key=key)
    if status != 200:
        raise refusal(url, status, answer, key)
    if args.json:
        print(json.dumps(answer, ensure_ascii=False, indent=1))
        return 0
    text = args.noul or args.choice or args.score
    color = sys.stdout.isatty()
    print(chart(text, answer["answers"]["q"], color, dialect=path.removeprefix("/v1/")))
    via = ", through /v1/systemone (more than 10 options)" if path == "/v1/systemone" else ""
    print(f"  model {answer.get('model')}, {answer.get('usage', {}).get('latency_ms', 0):.0f} ms{via}")
    return 0
