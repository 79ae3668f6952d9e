"""`basal-local prompts`: exactly what the model reads for a request on stdin (or the packed prefix tree)."""

from __future__ import annotations

import argparse
import json
import sys

from ..api import ApiError, parse_body, route, validate
from ..api.errors import protocol_error
from ..engine.packer import pack_prompts
from ..engine.plan import plan_request
from ..engine.pretty import format_pack
from ..model.directory import load_model_dir
from ..model.registry import DEMO_NAME
from ..protocol.errors import ProtocolError
from ..protocol.questions import detect_language
from . import UserError, model_path


def prompts_command(args: argparse.Namespace) -> int:
    model = load_model_dir(model_path(DEMO_NAME if args.demo else args.model), check_weights=False)
    if sys.stdin.isatty():
        print("basal-local: reading a request (JSON) from stdin; end with Ctrl-D, e.g.\n"
              "  basal-local prompts --demo < request.json", file=sys.stderr)
    raw = sys.stdin.buffer.read()
    if not raw.strip():
        raise UserError("no request on stdin", "pipe a request body in: basal-local prompts --demo < request.json")
    try:
        body = parse_body(raw, args.dialect)
        request = validate(body, args.dialect, route(body, args.dialect, {model.name: model}, model.name,
                                                     {"jev-latest": model.name}))
        prefixes = {lang: model.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
        try:
            plan = plan_request(request, model.tokenizer, model.config.max_position_embeddings, prefixes)
        except ProtocolError as exc:  # e.g. a prompt over the context: the dialect's answer
            raise protocol_error(exc, args.dialect) from None
    except ApiError as err:
        # the body the HTTP endpoint would answer; its status goes to stderr
        print(json.dumps(err.body, ensure_ascii=False))
        print(f"basal-local: the daemon would answer this request HTTP {err.status} with the body above",
              file=sys.stderr)
        return 2
    if args.tree:
        print(format_pack(pack_prompts(plan.prompt_specs(), prefixes), model.tokenizer))
        return 0
    questions = {}
    for q in request.questions:
        units = [qp for qp in plan.questions if qp.question.qid == q.qid]
        shown = [{"role": qp.role, "index": qp.index, "options": qp.members, "orders": [
            {"prompt": text, "input_ids": ids, "letter_ids": qp.letter_ids}
            for text, ids in zip(qp.prompts, qp.token_ids)]} for qp in units]
        entry = {"type": q.qtype, "language": units[0].lang if units else None,
                 "orders": shown[0]["orders"] if len(units) == 1 else []}
        if q.qtype == "multi" or q.large:  # branches / round-1 groups (round 2 depends on the answers)
            entry["units"] = shown
        questions[q.qid] = entry
    first = plan.questions[0].lang if plan.questions else detect_language(request.state_text, "")
    print(json.dumps({"language": first, "questions": questions}, ensure_ascii=False))
    return 0
