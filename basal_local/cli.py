"""The `basal-local` command: the argument parser and dispatch (implementations in basal_local/commands/)."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from . import __version__
from .commands import UserError
from .flags import add_flags
from .settings import config_path


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is two lines (what is wrong, where the help is), not the whole usage."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        self.argv = list(sys.argv[1:] if args is None else args)  # `error` looks at what came before the command
        return super().parse_args(args, namespace)

    def error(self, message: str):  # type: ignore[override]
        first = (getattr(self, "argv", None) or [""])[0].split("=")[0]  # the top-level parser's only
        if first.startswith("-") and first not in ("-h", "--help", "-v", "--verbose", "--version"):
            message = f"{first} is not an option of basal-local itself; a command's options go after it"
        self.exit(2, f"{self.prog}: error: {message}\n  see `{self.prog} -h`\n")


def _whole(low: int, high: int | None = None, what: str = ""):
    """An argparse type: a whole number from `low` (to `high`); `what` names the range in the message."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number{what}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} must be " + (f"from {low} to {high}" if high else
                                                                    f"at least {low}") + what)
        return value
    return parse


_port, _positive = _whole(1, 65535, " (a TCP port)"), _whole(1)


def _add_key_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key", dest="api_key", metavar="KEY",
                   help="the key of a daemon started with --api-key (default: BASAL_LOCAL_API_KEY, else the "
                        "config's api_key)")


def cmd_serve(args: argparse.Namespace) -> int:
    from .commands.serving import serve_command

    return serve_command(args)


def cmd_top(args: argparse.Namespace) -> int:
    from .commands.serving import client_key, daemon_url
    from .tui.run import run_top

    return run_top(daemon_url(args), api_key=client_key(args))  # --url, else a background daemon's, else the config's


def _lazy(module: str, func: str):
    """The command `func` of `commands/<module>.py`, imported only when it runs (so `-h` stays quick)."""

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(f".commands.{module}", __package__), func)(args)
    return run


EXAMPLES = {  # the `-h` description of each command without its own: what it does, then one example
    "serve": "basal-local serve --model mini   (or --demo: the bundled random-weight model)",
    "top": "basal-local top --url http://127.0.0.1:8000",
    "prompts": "basal-local prompts --demo < request.json",
    "make-test-model": "basal-local make-test-model /tmp/tiny --preset tiny",
    "pull": "basal-local pull mini",
    "list": "basal-local list --json",
    "show": "basal-local show mini",
    "rm": "basal-local rm mini --yes",
    "ps": "basal-local ps --url http://127.0.0.1:8000",
    "doctor": "basal-local doctor --json",
    "ask": 'basal-local ask --state "The parcel arrived broken." --noul "Is this urgent?"',
    "run": "basal-local run --input items.jsonl --output answers.jsonl --concurrency 8",
    "stop": "basal-local stop --timeout 60",
    "restart": "basal-local restart",
    "status": "basal-local status",
    "logs": "basal-local logs -f -n 50",
    "bench": "basal-local bench --model mini --device cuda   (or --http http://127.0.0.1:8000 --clients 32)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="basal-local", epilog="`basal-local COMMAND -h` explains each command.", description="Run "
                     "Basal typed-decision models on this machine: the daemon and the tools around it.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (and show tracebacks)")
    parser.add_argument("--version", action="version", version=f"basal-local {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the daemon")
    p.add_argument("--demo", action="store_true", help="serve the bundled demo model (random weights)")
    p.add_argument("--config", help=f"config.toml to read (default {config_path()})")
    add_flags(p)  # every setting with a flag (basal_local/settings.py)
    p.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: one engine replica per GPU (or CPU) actor of a Ray cluster, "
                        "behind this daemon on --host/--port (needs the extra: pip install 'basal-local[ray]')")
    p.add_argument("--ray-address", dest="ray_address", metavar="ADDR",
                   help="with --ray: the cluster to join (auto, or HOST:6379); default: start one on this machine")
    p.add_argument("--min-replicas", type=_positive, dest="min_replicas",
                   help="with --ray: engine replicas to keep (default 1)")
    p.add_argument("--max-replicas", type=_positive, dest="max_replicas",
                   help="with --ray: autoscale up to this many (default: every GPU of the cluster, or --min-replicas "
                        "on CPUs)")
    p.add_argument("--tui", action="store_true", help="show the live dashboard (basal-local top) in this terminal")
    p.add_argument("--detach", action="store_true", help="run in the background (pid and port in the state folder; "
                   "`basal-local status`, `logs -f`, `stop`)")
    p.add_argument("--demo-traffic", action="store_true", dest="demo_traffic",
                   help="send the bundled sample requests in a loop (to watch the dashboard move)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("top", help="live dashboard of a running daemon")
    p.add_argument("--url", help="the daemon's address (default: the configured host and port)")
    p.add_argument("--config", help="config.toml (default: the user config folder)")
    _add_key_flag(p)
    p.set_defaults(func=cmd_top)

    p = sub.add_parser("prompts", help="show exactly what the model reads for a request on stdin")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model directory or downloaded name")
    src.add_argument("--demo", action="store_true", help="use the demo model")
    p.add_argument("--dialect", choices=["systemone", "basal"], default="systemone", help="(default systemone)")
    p.add_argument("--tree", action="store_true", help="print the packed prefix tree instead")
    p.set_defaults(func=_lazy("prompts", "prompts_command"))

    p = sub.add_parser("make-test-model", help="write a random-weight model directory of the contract")
    p.add_argument("directory", help="folder to write (created)")
    p.add_argument("--preset", default="tiny", choices=["tiny", "tiny64", "tiny256", "small", "mini", "4.5B", "max"],
                   help="architecture (default tiny; mini/4.5B/max are the real Basal shapes)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--name", help="served model name (default basal-test-PRESET)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="where to draw the random weights (default cpu; cuda is faster)")
    p.add_argument("--evidence-head", action=argparse.BooleanOptionalAction, default=None,
                   help="write a random evidence_head.pt (default: for the tiny and small presets)")
    p.add_argument("--format", default="bf16", choices=["bf16", "mlx-8bit", "mlx-fp4", "gguf-q8_0", "gguf-q4_k_m",
                                                         "fp8"],
                   help="weight layout of a shipped port (default bf16): MLX 8-bit/nvfp4 (mlx-lm layout, needs "
                        "mlx), GGUF Q8_0/Q4_K_M (the gguf package's writer) or NVIDIA ModelOpt FP8")
    p.set_defaults(func=_lazy("maketest", "make_test_model"))

    p = sub.add_parser("pull", help="download a model into the Hugging Face cache (resumable)")
    p.add_argument("ref", help="mini, 4.5B, max or OWNER/NAME[@REVISION]")
    p.set_defaults(func=_lazy("models", "pull"))

    p = sub.add_parser("list", aliases=["ls"], help="models downloaded (and the demo model)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_lazy("models", "list_"))

    p = sub.add_parser("show", help="a model's architecture, calibration and files")
    p.add_argument("ref", help="name (mini, OWNER/NAME, basal-demo) or model directory")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_lazy("models", "show"))

    p = sub.add_parser("rm", help="delete a downloaded model from the cache")
    p.add_argument("ref", help="mini, 4.5B, max, OWNER/NAME[@REVISION] or basal-demo")
    p.add_argument("-y", "--yes", action="store_true", help="do not ask")
    p.set_defaults(func=_lazy("models", "rm"))

    p = sub.add_parser("ps", help="what a running daemon has loaded, and its memory")
    p.add_argument("--url", default=None, help="daemon URL (default http://HOST:PORT from the config)")
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_key_flag(p)
    p.set_defaults(func=_lazy("models", "ps"))

    p = sub.add_parser("load", help="a running daemon loads a model (no restart)",
                       description="Load a model into a running daemon; it stays loaded for --keep-alive after its "
                       "last request (default: the daemon's --keep-alive, else until it stops). A request for a "
                       "known model that is not loaded loads it too (503 + Retry-After meanwhile). "
                       "Example: basal-local load mini --keep-alive 10m")
    p.add_argument("model", help="a served name, mini|4.5B|max, OWNER/NAME[@REV] (downloaded) or a model directory")
    p.add_argument("--keep-alive", dest="keep_alive", metavar="TIME",
                   help="unload after this long without a request: 10m, 1h, 90s, 600 (seconds), or forever")
    p.add_argument("--no-wait", action="store_true", dest="no_wait", help="return at once (default: wait for it)")
    p.add_argument("--url", default=None, help="daemon URL (default http://HOST:PORT from the config)")
    _add_key_flag(p)
    p.set_defaults(func=_lazy("models", "load"))

    p = sub.add_parser("unload", help="a running daemon unloads a model and frees its memory",
                       description="Unload a model from a running daemon: it finishes the requests it holds, then its "
                       "weights and memory are freed. A later request for it loads it again. "
                       "Example: basal-local unload basal-1.5-mini")
    p.add_argument("model", help="the served name (`basal-local ps` lists them)")
    p.add_argument("--no-wait", action="store_true", dest="no_wait", help="return at once (default: wait for it)")
    p.add_argument("--url", default=None, help="daemon URL (default http://HOST:PORT from the config)")
    _add_key_flag(p)
    p.set_defaults(func=_lazy("models", "unload"))

    p = sub.add_parser("doctor", help="check this machine: Python, packages, devices, models, disk, port, config")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--port", type=_port, help="port to check (default: the configured one)")
    p.set_defaults(func=_lazy("doctor", "doctor_command"))

    p = sub.add_parser("ask", help="one decision through a running daemon, as a bar chart")
    p.add_argument("--url", default=None, help="daemon URL (default http://HOST:PORT from the config)")
    p.add_argument("--model", help="served model name (default: the daemon's default)")
    p.add_argument("--state", required=True, help="the text to decide about, or @FILE to read it from a file")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--noul", metavar="Q", help="a yes/no question")
    kind.add_argument("--choice", metavar="Q", help="a choice question (give the options with -o)")
    kind.add_argument("--score", metavar="Q", help="a score question (give the levels with -l)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="KEY=DESCRIPTION",
                   help="a choice option (repeat, at least 2)")
    p.add_argument("-l", "--level", action="append", default=[], metavar="LEVEL",
                   help="a score level, lowest first (repeat, at least 2)")
    p.add_argument("--json", action="store_true", help="print the daemon's JSON answer")
    _add_key_flag(p)
    p.set_defaults(func=_lazy("ask", "ask_command"))

    p = sub.add_parser("run", help="decide every request of a JSONL file through a running daemon")
    p.add_argument("--url", default=None, help="daemon URL (default http://HOST:PORT from the config)")
    p.add_argument("--input", required=True, help="JSONL: full System One requests or {state, question, "
                                                  "options, gold?} items")
    p.add_argument("--output", required=True, help="JSONL to write, one answer per input line (written as they come, "
                   "with an index; in input order once all are done); never the input file")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--resume", action="store_true", help="keep the answers already in --output (an interrupted "
                     "run) and ask only the rest and the failed ones")
    how.add_argument("--overwrite", action="store_true", help="replace an --output that already holds lines "
                     "(without it, or --resume, such a file is refused)")
    p.add_argument("--model", help="served model name for items that name none")
    p.add_argument("--concurrency", type=_positive, default=8, help="requests in flight (default 8)")
    _add_key_flag(p)
    p.set_defaults(func=_lazy("batch", "run_command"))

    p = sub.add_parser("batch", help="the Batch API of a running daemon: submit a JSONL file, follow, fetch results",
                       description="Submit JSONL files of /v1/basal requests ({\"custom_id\", \"body\"} a line) to a "
                       "running daemon, which runs them in the background while no interactive request waits. "
                       "Example: basal-local batch submit requests.jsonl --wait && basal-local batch results ID")
    p.add_argument("action", choices=["submit", "list", "status", "cancel", "results"])
    p.add_argument("target", nargs="?", help="submit: the JSONL file; status, cancel, results: the batch id")
    p.add_argument("--url", default=None, help="daemon URL (default http://HOST:PORT from the config)")
    p.add_argument("--wait", action="store_true", help="submit: follow the batch with a progress bar until it ends")
    p.add_argument("--output", help="results: write to this file instead of stdout")
    p.add_argument("--errors", action="store_true", help="results: the error lines too")
    p.add_argument("--json", action="store_true", help="print the batch objects as JSON")
    _add_key_flag(p)
    p.set_defaults(func=_lazy("batches", "batch_command"))

    p = sub.add_parser("service", help="run the daemon in the background (systemd user unit / launchd agent)",
                       description="Install the daemon as a systemd user unit (Linux) or launchd agent (macOS), then "
                       "start, stop, restart it and read its logs through the service manager. Example: "
                       "basal-local service install --model mini && basal-local service start")
    p.add_argument("action", choices=["install", "uninstall", "status", "start", "stop", "restart", "logs"])
    p.add_argument("-f", "--follow", action="store_true", help="logs: keep printing new lines until Ctrl-C")
    p.add_argument("-n", "--lines", type=int, default=0, metavar="N", help="logs: only the last N lines first")
    p.add_argument("--model", action="append", help="model to serve (repeatable; default: the config's)")
    p.add_argument("--port", type=_port, help="port (default: the config's)")
    p.add_argument("--print", action="store_true", dest="dry_run", help="print the unit instead of writing it")
    p.set_defaults(func=_lazy("service", "service_command"))

    p = sub.add_parser("config", help="the effective settings and where each came from; edit config.toml",
                       description="Show the settings `serve` would use and where each came from (default, "
                       "config.toml, a BASAL_LOCAL_* variable, a flag), or edit config.toml with every value checked "
                       "first. Example: basal-local config set port 8001 && basal-local config")
    p.add_argument("action", nargs="?", default="show", choices=["show", "path", "get", "set", "unset", "keys",
                                                                  "validate"], help="(default show)")
    p.add_argument("key", nargs="?", help="get, set, unset: the setting (`config keys` lists them; aliases.NAME, "
                   "placement.NAME for the tables)")
    p.add_argument("value", nargs="?", help="set: the value (a list: comma-separated)")
    p.add_argument("--config", help=f"config.toml to read and edit (default {config_path()})")
    p.add_argument("--json", action="store_true", help="show, keys: print JSON")
    g = p.add_argument_group("serve flags (show: what `serve` would use with them)")
    add_flags(g, headings=False)
    p.set_defaults(func=_lazy("config", "config_command"))

    p = sub.add_parser("completion", help="print a shell completion script (bash, zsh or fish)",
                       description="Print the completion script of a shell. Examples: eval \"$(basal-local "
                       "completion bash)\" in ~/.bashrc; basal-local completion fish > "
                       "~/.config/fish/completions/basal-local.fish; basal-local completion zsh > "
                       "\"${fpath[1]}/_basal-local\"")
    p.add_argument("shell", choices=["bash", "zsh", "fish"])
    p.set_defaults(func=_lazy("completion", "completion_command"))

    p = sub.add_parser("stop", help="stop the daemon started with `serve --detach`")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for it (default 30)")
    p.set_defaults(func=_lazy("background", "stop_command"))
    p = sub.add_parser("restart", help="stop the `serve --detach` daemon and start it again (same arguments, port)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for it to stop (default 30)")
    p.set_defaults(func=_lazy("background", "restart_command"))
    p = sub.add_parser("status", help="whether the `serve --detach` daemon runs, where, and if it is ready")
    p.set_defaults(func=_lazy("background", "status_command"))
    p = sub.add_parser("logs", help="the daemon's log file (-f: follow it)")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    p.add_argument("-n", "--lines", type=int, default=0, metavar="N", help="only the last N lines first")
    p.set_defaults(func=_lazy("background", "logs_command"))

    p = sub.add_parser("bench", help="measure latency and throughput")
    p.add_argument("--model", help="model directory or downloaded name (default: the demo model)")
    p.add_argument("--backend", choices=["auto", "torch", "mlx"], default="auto", help="(default auto)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="(default auto)")
    p.add_argument("--dtype", default="auto", choices=["auto", "f16", "bf16", "f32", "fp8"],
                   help="(default auto; fp8: CUDA only, f16 with float8 GEMMs; an FP8 checkpoint runs its own fp8 "
                        "GEMMs on CUDA under auto, dequantized on the CPU)")
    p.add_argument("--gpu-memory", dest="gpu_memory", metavar="SIZE",
                   help="in-process: GPU memory the model may use, a size (24GB) or a share (0.8) (default: all)")
    p.add_argument("--repeat", type=_positive, default=1, help="passes over the sample set (default 1)")
    p.add_argument("--decisions", type=_positive, metavar="N",
                   help="in-process: only the first N decisions of the sample set (default: all 67)")
    p.add_argument("--http", help="URL of a running daemon: measure over HTTP instead")
    p.add_argument("--clients", type=_positive, default=1, help="concurrent HTTP clients (default 1)")
    p.add_argument("--requests", type=int, default=0, help="HTTP requests to send (default: the sample set)")
    p.add_argument("--new-connections", action="store_true",
                   help="open a new HTTP connection per request (default: each client keeps its connection)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    _add_key_flag(p)
    p.add_argument("--attention", choices=["auto", "tree", "sdpa", "metal"], default="auto",
                   help="the forward's ops: tree = the Triton kernels (CUDA default), sdpa = their plain-torch / MLX "
                        "twins (CPU default), metal = the Metal kernel (MLX on a Mac)")
    add_flags(p, "torch")  # the torch backend's options, as `serve` declares them
    p.add_argument("--baseline", choices=["none", "transformers", "transformers-compiled", "both"], default="none",
                   help="also time Hugging Face transformers on the same decisions (side by side): eager, "
                        "under torch.compile(mode='reduce-overhead'), or both")
    p.add_argument("--long-doc", action="store_true", dest="long_doc",
                   help="also time a synthetic ~4.2k- and ~16.5k-token contract with 5 questions")
    p.add_argument("--invariance", type=int, default=0, metavar="N",
                   help="also check N times that a request alone and amid 31 others gets bitwise equal logits")
    p.add_argument("--cache", action="store_true",
                   help="in-process: the state cache's figures instead: a long document with 5 questions, then 5 other "
                        "questions, on an engine caching only the templates and on one with the cache (side by side)")
    p.add_argument("--doc-tokens", type=_positive, default=17800, metavar="N",
                   help="with --cache: the document's length in tokens (default 17800)")
    p.add_argument("--documents", type=_positive, default=0, metavar="N",
                   help="with --cache: documents to time (default 3); with --http: a mixed stream of N documents, "
                        "--per-document requests each, in random order")
    p.add_argument("--per-document", type=_positive, default=10, metavar="N", dest="per_document",
                   help="with --http --documents: requests per document (default 10)")
    p.set_defaults(func=_lazy("benching", "bench_command"))
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, example in EXAMPLES.items():
        sub.choices[name].description = f"{helps[name][0].upper()}{helps[name][1:]}. Example: {example}"
    seen: set[int] = set()
    for command in sub.choices.values():  # -v after the subcommand too (`basal-local serve -v`)
        if id(command) not in seen:
            seen.add(id(command))
            command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                                 help="log more (and show tracebacks)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `serve --detach` starts the same command again
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="basal-local: %(levelname)s %(name)s: %(message)s")
    try:
        status = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handlers below, not at exit
        return status
    except UserError as err:
        print("\n".join(err.lines()), file=sys.stderr)
        return err.status
    except KeyboardInterrupt:
        print("basal-local: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `basal-local list | head -1`: the reader left; stay quiet (and keep Python from complaining at exit)
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        return 141
    except OSError as exc:
        if exc.filename is None or args.verbose:
            raise
        # a path the file system refuses (a folder through a file, no permission, a full disk): the user's to fix
        print(f"basal-local: error: cannot use {exc.filename} ({exc.strerror or type(exc).__name__})\n  check that "
              "path, its permissions and the free disk space (BASAL_LOCAL_HOME moves basal-local's own folders)",
              file=sys.stderr)
        return 1
    except Exception as exc:  # a bug: one line, the traceback only with -v
        if args.verbose:
            raise
        print(f"basal-local: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        print("  run again with -v for the traceback, and please report it", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
