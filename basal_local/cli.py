"""The `basal-local` command: serve, prompts, make-test-model, pull, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

DEMO_BANNER = """\
basal-local demo: serving the bundled demo model "basal-demo" on http://{host}:{port}
  The demo model has RANDOM weights: its answers are random. It shows the API, not a real decision model.
  Get a real model with `basal-local pull mini` and start it with `basal-local serve --model mini`.

Try it:
  curl -s http://{host}:{port}/v1/systemone -H 'content-type: application/json' -d '{{"model": "basal-demo", "state": "The parcel arrived broken.",
    "questions": {{"urgent": {{"type": "noul", "instructions": "Is this urgent?"}}}}}}'

  python - <<'PY'
  import json, urllib.request
  body = {{"model": "basal-demo", "state": "Paczka dotarła uszkodzona.",
          "questions": {{"kind": {{"type": "choice", "criteria": {{"damage": "Uszkodzenie", "late": "Opóźnienie"}}}}}}}}
  req = urllib.request.Request("http://{host}:{port}/v1/systemone", json.dumps(body).encode())
  print(json.load(urllib.request.urlopen(req)))
  PY
Stop with Ctrl-C."""

NO_MODEL = """\
basal-local: error: no model to serve.
  Try the demo (random weights, answers are random):  basal-local serve --demo
  Serve a real model: basal-local pull mini && basal-local serve --model mini
  or point at a model directory:                      basal-local serve --model /path/to/basal-1.5-mini"""


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-tokens", type=int, dest="max_batch_tokens")
    p.add_argument("--schedule", choices=["hrrn", "fifo"])
    p.add_argument("--long-tokens", type=int, dest="long_tokens", help="long-lane threshold; 0 disables")
    p.add_argument("--long-slice-ms", type=float, dest="long_slice_ms")
    p.add_argument("--no-prefix-cache", action="store_false", dest="prefix_cache", default=None)


def cmd_serve(args: argparse.Namespace) -> int:
    from .model.directory import ModelLoadError, load_model_dir
    from .model.registry import ModelNotFound, demo_model_dir, resolve_model
    from .server.daemon import serve
    from .server.settings import Settings

    overrides = {k: getattr(args, k) for k in ("host", "port", "backend", "device", "devices", "replicas", "dtype",
                                               "default_model",
                                               "max_inflight", "max_batch_tokens", "schedule", "long_tokens",
                                               "long_slice_ms", "prefix_cache")}
    overrides["access_log"] = args.access_log or None
    for key in ("api_key", "body_timeout_s", "drain_s", "allowed_hosts", "allowed_origins"):
        overrides[key] = getattr(args, key)
    overrides["insecure_public"] = args.insecure_public or None
    overrides["log_bodies"] = args.log_bodies or None
    if args.model:
        overrides["models"] = args.model
    try:
        settings = Settings.load(overrides, Path(args.config) if args.config else None)
        from basal_local.backends.select import check_dtype

        check_dtype(settings.backend, settings.device, settings.dtype)
    except (ValueError, OSError) as exc:
        print(f"basal-local: error: {exc}", file=sys.stderr)
        return 2
    from .server.security import public_bind_refusal

    refusal = public_bind_refusal(settings.host, settings.api_key, settings.insecure_public)
    if refusal:
        print(f"basal-local: error: {refusal}", file=sys.stderr)
        return 2
    dirs: list[Path] = []
    banner = ""
    if args.demo:
        print("basal-local: preparing the demo model (generated once, a few seconds)...", flush=True)
        dirs.append(demo_model_dir())
        banner = DEMO_BANNER.format(host=settings.host, port=settings.port)
    if not settings.models and not args.demo:
        print(NO_MODEL, file=sys.stderr)
        return 2
    try:
        for ref in settings.models:
            path = resolve_model(ref)
            load_model_dir(path, check_weights=True)  # refuse early, with the file and field named
            dirs.append(path)
    except (ModelNotFound, ModelLoadError) as exc:
        print(f"basal-local: error: {exc}", file=sys.stderr)
        return 2
    if not banner:
        banner = f"basal-local: serving on http://{settings.host}:{settings.port} (loading models...)"
    if args.tui or args.demo_traffic:
        from .server.tuimode import serve_with_options

        return serve_with_options(settings, dirs, banner, args.tui, args.demo_traffic)
    serve(settings, dirs, banner)
    # Everything is stopped and flushed; the interpreter's final garbage collection of a loaded model can take
    # seconds, which would stretch a SIGTERM past its drain deadline. Leave now, with success.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cmd_prompts(args: argparse.Namespace) -> int:
    from .api import ApiError, parse_body, route, validate
    from .engine.packer import pack_prompts
    from .engine.plan import plan_request
    from .model.directory import load_model_dir
    from .protocol.questions import detect_language

    model = load_model_dir(args.model, check_weights=False)
    try:
        body = parse_body(sys.stdin.buffer.read(), args.dialect)
        request = validate(body, args.dialect, route(body, args.dialect, {model.name: model}, model.name))
        prefixes = {lang: model.tokenizer.template_prefix(lang) for lang in ("pl", "en")}
        plan = plan_request(request, model.tokenizer, model.config.max_position_embeddings, prefixes)
    except ApiError as err:
        # the body the HTTP endpoint would answer; its status goes to stderr
        print(json.dumps(err.body, ensure_ascii=False))
        print(f"basal-local: HTTP {err.status}", file=sys.stderr)
        return 2
    if args.tree:
        from .engine.pretty import format_pack

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


def cmd_make_test_model(args: argparse.Namespace) -> int:
    from .model.testmodel import make_test_model

    out = make_test_model(args.directory, preset=args.preset, seed=args.seed, name=args.name, device=args.device,
                          evidence_head=args.evidence_head)
    print(f"basal-local: wrote {args.preset} test model to {out}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from .model.registry import pull

    print(f"basal-local: downloaded to {pull(args.ref)}")
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from .server.settings import Settings
    from .server.tuimode import local_url

    url = args.url
    if not url:
        try:
            settings = Settings.load({}, Path(args.config) if args.config else None)
        except (ValueError, OSError) as exc:
            print(f"basal-local: error: {exc}", file=sys.stderr)
            return 2
        url = local_url(settings.host, settings.port)
    from .tui.run import run_top

    return run_top(url)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="basal-local", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--model", action="append", help="model directory or name (repeatable)")
    p.add_argument("--demo", action="store_true", help="serve the bundled demo model (random weights)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--backend", choices=["auto", "torch", "mlx"])
    p.add_argument("--device", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--devices", help="one engine replica per device: cuda:0,cuda:1 or all (overrides --device)")
    p.add_argument("--replicas", type=int, help="engine replicas per device (default 1)")
    p.add_argument("--dtype", choices=["auto", "f16", "bf16", "f32", "q8", "q4"],
                   help="q8/q4: MLX backend only (quantized once, cached in the user cache folder)")
    p.add_argument("--default-model", dest="default_model")
    p.add_argument("--max-inflight", type=int, dest="max_inflight")
    p.add_argument("--config", help="config.toml (default: the user config folder)")
    p.add_argument("--access-log", action="store_true", dest="access_log")
    p.add_argument("--api-key", dest="api_key", help="require this key (Authorization: Bearer KEY or X-Api-Key); "
                   "also BASAL_LOCAL_API_KEY")
    p.add_argument("--insecure-public", action="store_true", dest="insecure_public",
                   help="allow serving off loopback (e.g. --host 0.0.0.0) without an API key")
    p.add_argument("--allowed-host", action="append", dest="allowed_hosts", metavar="NAME",
                   help="another Host name the daemon answers to (repeatable; '*' allows any)")
    p.add_argument("--allowed-origin", action="append", dest="allowed_origins", metavar="ORIGIN",
                   help="a web origin allowed to call the daemon, e.g. https://app.example (repeatable)")
    p.add_argument("--log-bodies", action="store_true", dest="log_bodies", help="log request bodies (off: "
                   "no request content is logged)")
    p.add_argument("--body-timeout", type=float, dest="body_timeout_s", metavar="SECONDS",
                   help="close a connection whose request body has not arrived in this time (default 10)")
    p.add_argument("--drain", type=float, dest="drain_s", metavar="SECONDS",
                   help="on SIGTERM, wait this long for requests in flight (default 10)")
    p.add_argument("--tui", action="store_true", help="show the live dashboard (basal-local top) in this terminal")
    p.add_argument("--demo-traffic", action="store_true", dest="demo_traffic",
                   help="send the bundled sample requests in a loop (to watch the dashboard move)")
    _add_engine_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("top", help="live dashboard of a running daemon")
    p.add_argument("--url", help="the daemon's address (default: the configured host and port)")
    p.add_argument("--config", help="config.toml (default: the user config folder)")
    p.set_defaults(func=cmd_top)

    p = sub.add_parser("prompts", help="show exactly what the model reads for a request on stdin")
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--dialect", choices=["systemone", "basal"], default="systemone")
    p.add_argument("--tree", action="store_true", help="print the packed prefix tree instead")
    p.set_defaults(func=cmd_prompts)

    p = sub.add_parser("make-test-model", help="write a random-weight model directory of the contract")
    p.add_argument("directory")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "mini", "4.5B", "max"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name")
    p.add_argument("--device", default="cpu", help="where to draw the random weights (cuda is faster)")
    p.add_argument("--evidence-head", action=argparse.BooleanOptionalAction, default=None,
                   help="write a random evidence_head.pt (default: for the tiny and small presets)")
    p.set_defaults(func=cmd_make_test_model)

    p = sub.add_parser("pull", help="download a model into the Hugging Face cache")
    p.add_argument("ref", help="mini, 4.5B, max or owner/name[@revision]")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("bench", help="measure latency and throughput")
    p.add_argument("--model", help="model directory (default: the demo model)")
    p.add_argument("--backend", choices=["auto", "torch", "mlx"], default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--http", help="URL of a running daemon: measure over HTTP instead")
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--requests", type=int, default=0, help="HTTP requests to send (default: the sample set)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--attention", choices=["auto", "tree", "sdpa", "flex"], default="auto",
                   help="tree attention: the Triton kernel (CUDA default), the dense-mask SDPA twin (CPU default) "
                        "or the FlexAttention kernel")
    p.add_argument("--baseline", choices=["none", "transformers", "transformers-compiled", "both"], default="none",
                   help="also time Hugging Face transformers on the same decisions (side by side): eager, "
                        "under torch.compile(mode='reduce-overhead'), or both")
    p.add_argument("--long-doc", action="store_true", dest="long_doc",
                   help="also time a synthetic ~4.2k- and ~16.5k-token contract with 5 questions")
    p.add_argument("--invariance", type=int, default=0, metavar="N",
                   help="also check N times that a request alone and amid 31 others gets bitwise equal logits")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="basal-local: %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
