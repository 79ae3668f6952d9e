"""Every setting declared once (STYLE.md 16-17): its field, type, default, range, `config.toml` key, CLI flag and
`--help` text, in one `setting(...)` call (declare.py) on a field of `EngineSettings` or `Settings` (the torch
backend's options are fields of `Settings` in the group "torch": `Settings.torch_options()` gives the backend its
`TorchOptions`).

From those declarations flags.py builds the `serve` flags (their help ends in the declared default) and
`Settings.load` reads `config.toml` (an unknown key is an error naming the file, the key and the nearest known
one), the environment and the flags, each value checked by `declare.check`.
Order: CLI flags > environment > config.toml > defaults.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .backends.torch.options import FP8_GEMMS, GEMM_ROUTES, TorchOptions
from .declare import Spec, check, declared, setting
from .paths import home_dirs


@dataclass
class EngineSettings:
    """The engine's knobs (DESIGN.md "Scheduling"), the same for every model."""

    max_batch_tokens: int = setting(8192, "tokens one batch may grow its prefix trees by", flag="--max-batch-tokens",
                                    minimum=1)
    schedule: str = setting("hrrn", "queue order", flag="--schedule", choices=("hrrn", "fifo"))
    long_tokens: int = setting(4096, "requests of this many tokens go to the preemptible long lane; 0 disables",
                               flag="--long-tokens", minimum=0)
    long_slice_ms: float = setting(100.0, "how long the long lane may hold the device while others wait",
                                   flag="--long-slice-ms", above=0)
    max_row_tokens: int = setting(32768, "tokens one row of a forward may hold", minimum=1)
    max_forward_tokens: int = setting(8192, "tokens one forward may hold (CUDA graphs are captured up to it)",
                                      minimum=1)
    # the state cache (engine/prefix_cache.py): K/V of templates and documents kept for later requests
    prefix_cache: str = setting("auto", "memory for K/V kept between requests (the templates, and documents, so a new "
                                        "question about a known document computes only its own tokens): a size "
                                        "(8GB) or a share of the free GPU memory (0.5, 50%%; without a GPU of the "
                                        "available RAM, all of it on a Mac), per replica; auto (most of a large "
                                        "GPU's free memory, little on the CPU or a Mac) or off", flag="--prefix-cache",
                                metavar="SIZE|SHARE|auto|off", number_ok=True, validate="prefix_cache")
    # after a batch of n requests, wait up to this long (and at most a quarter of that batch's time) for n/2 to
    # queue before starting a small batch, so closed-loop clients do not alternate full and tiny batches.
    # Off by default: 20 ms on the H200 (32 HTTP clients) gave p99 282 vs 314 ms and -1.5 % req/s, one trial
    # each, within noise (docs/PERFORMANCE.md)
    coalesce_ms: float = setting(0.0, "after a batch of n requests, wait up to this long for n/2 to queue before "
                                      "a small batch; 0 disables", flag="--coalesce-ms", minimum=0)
    # overlap a batch's host work (packing, inputs, answering) with the previous batch's device work where the
    # backend can launch without waiting (engine/engine.py)
    pipeline: bool = setting(True, "answer each batch before forming the next (default: on CUDA, the next batch is "
                                   "packed and launched while the device computes the one before)",
                             flag="--no-pipeline", action="negate", show_default=False)


@dataclass
class Settings:
    """The daemon's settings; `engine` holds the engine's."""

    models: list[str] = setting([], "model directory, or a downloaded name (mini, 4.5B, max, OWNER/NAME); repeatable",
                                flag="--model", dest="model", action="append", show_default=False)
    host: str = setting("127.0.0.1", "address to listen on; 127.0.0.1 is this machine only", flag="--host",
                        env="BASAL_LOCAL_HOST")
    port: int = setting(8000, "TCP port (the flag also takes 0: a free one, printed)", flag="--port", minimum=1,
                        maximum=65535,
                        env="BASAL_LOCAL_PORT", flag_zero=True)
    backend: str = setting("auto", "compute backend", flag="--backend", choices=("auto", "torch", "mlx"),
                           env="BASAL_LOCAL_BACKEND")
    device: str = setting("auto", "device (auto: cuda when available, else cpu)", flag="--device",
                          choices=("auto", "cpu", "cuda", "mps"), env="BASAL_LOCAL_DEVICE")
    devices: str | None = setting(None, "one engine replica per device: cuda:0,cuda:1 or all (overrides --device)",
                                  kind=str, flag="--devices", optional=True, show_default=False)
    replicas: int = setting(1, "engine replicas per device", flag="--replicas", minimum=1)
    # each replica in its own worker process (replicas/front.py); None: when a model is on more than one GPU
    replica_processes: bool | None = setting(
        None, "each engine replica in its own process, the HTTP front in this one (default: on when a model runs on "
              "more than one GPU; --no-replica-processes keeps them in one process)", kind=bool,
        flag="--replica-processes", action="boolean", optional=True, show_default=False)
    placement: dict[str, list[str]] = setting({}, "config.toml [placement]: model name -> its devices")
    dtype: str = setting("auto", "weights and activations (auto: f16 on GPUs, f32 on the CPU; fp8: CUDA only, f16 "
                                 "with float8 GEMMs; q8/q4: MLX only, quantized once and cached). Shipped ports run in their own "
                                 "format: MLX-8bit/fp4 quantized on MLX, GGUF Q8_0/Q4_0 natively on MLX and dequantized "
                                 "at load elsewhere, ModelOpt FP8 on its own e4m3 weights and scales on CUDA (auto or fp8; needs "
                                 "compute capability 8.9+) and dequantized at load to f32 on the CPU or to an explicit "
                                 "f16/bf16/f32", flag="--dtype",
                         choices=("auto", "f16", "bf16", "f32", "fp8", "q8", "q4"), env="BASAL_LOCAL_DTYPE")
    # a size (24GB) or a share (0.8) of each GPU's memory the models may use (backends/memory.py checks the form)
    gpu_memory: str | float | None = setting(
        None, "GPU memory the models may use on each device: a size (24GB, 22.5GiB) or a share (0.8, 80%%); the "
              "weights must fit, and a batch that needs more gets a 503 (default: all of it)", kind=str,
        flag="--gpu-memory", metavar="SIZE", optional=True, number_ok=True, env="BASAL_LOCAL_GPU_MEMORY", show_default=False)
    default_model: str | None = setting(None, "model for requests that name none (default: the first --model)",
                                        kind=str, flag="--default-model", optional=True, show_default=False)
    max_inflight: int = setting(1024, "requests admitted at once; more get 529 + Retry-After", flag="--max-inflight",
                                minimum=1)
    # the longest wait for a place before a 529 (engine/gate.py Admission)
    admission_wait_ms: float = setting(100.0, "longest wait for a place before a 529, at most two places' turnover; "
                                              "0: none", flag="--admission-wait-ms", metavar="MS", minimum=0)
    release_date: str = setting("2026-10-05", "the release date /v1/models shows")
    access_log: bool = setting(False, "one log line per request", flag="--access-log", action="store_true",
                               show_default=False)
    # who may call (server/security.py)
    api_key: str | None = setting(None, "require this key (Authorization: Bearer KEY or X-Api-Key)", kind=str,
                                  flag="--api-key", optional=True, env="BASAL_LOCAL_API_KEY", show_default=False)
    insecure_public: bool = setting(False, "allow serving off loopback (e.g. --host 0.0.0.0) without an API key",
                                    flag="--insecure-public", action="store_true", show_default=False)
    allowed_hosts: list[str] = setting([], "another Host name the daemon answers to (repeatable; '*' allows any)",
                                       flag="--allowed-host", action="append", metavar="NAME", show_default=False)
    allowed_origins: list[str] = setting([], "a web origin allowed to call the daemon, e.g. https://app.example "
                                             "(repeatable)", flag="--allowed-origin", action="append",
                                         metavar="ORIGIN", show_default=False)
    log_bodies: bool = setting(False, "log request bodies (off: no request content is logged)", flag="--log-bodies",
                               action="store_true", show_default=False)
    # limits (server/body.py); drain_s: how long SIGTERM waits for requests in flight
    max_body_mb: int = setting(32, "largest request body, in MiB", minimum=1)
    body_timeout_s: float = setting(10.0, "close a connection whose request body has not arrived in this time",
                                    flag="--body-timeout", metavar="SECONDS", above=0)
    drain_s: float = setting(10.0, "on SIGTERM, wait this long for requests in flight", flag="--drain",
                             metavar="SECONDS", minimum=0)
    metrics: bool = setting(False, "Prometheus text at /metrics", flag="--metrics", action="store_true")
    # models at run time (server/models.py): `basal-local load NAME --keep-alive 10m` sets one model's own
    keep_alive_s: float | None = setting(None, "unload a model after this long without a request (10m, 1h, 600 "
                                               "seconds, forever); it loads again on the next one (default: never)",
                                         kind=float,
                                         flag="--keep-alive", metavar="TIME", minimum=0, optional=True,
                                         show_default=False, duration=True)
    # [aliases]: extra names a request may use for a served model (jev-latest = "mini")
    aliases: dict[str, str] = setting({}, 'config.toml [aliases]: extra names for served models (jev-latest = "mini")')
    # the torch backend's product options (backends/torch/options.py TorchOptions: their defaults, and the measuring
    # tools' knobs); they act on CUDA, the CPU reference ignores them
    gemm: str = setting(TorchOptions.gemm, "CUDA GEMM route: cuBLAS at row counts verified to give the same bits "
                                           "(verified), fixed row chunks (chunked) or plain cuBLAS, which is not "
                                           "batch-invariant (cublas)", flag="--gemm",
                        choices=GEMM_ROUTES, group="torch")
    cublaslt: bool = setting(TorchOptions.cublaslt, "pinned cuBLASLt algorithms where they give the same bits and "
                                                    "are faster (--no-cublaslt: never)", flag="--no-cublaslt",
                             action="negate", show_default=False, group="torch")
    fp8_gemms: list[str] = setting(list(TorchOptions.fp8_gemms), "with --dtype fp8: the projections quantized to "
                                                                 "float8", kind=list, flag="--fp8-gemms",
                                   metavar="LIST", items=FP8_GEMMS, comma=True, group="torch")
    attention_alt_tiling: bool = setting(TorchOptions.attention_alt_tiling, "the 128-query attention tiling for "
                                         "small forwards and the 256-query one for long ones, where they give the "
                                         "default tiling's bits (--no-alt-tiling: never)", flag="--no-alt-tiling",
                                         action="negate", show_default=False, group="torch")
    cuda_graphs: bool = setting(TorchOptions.cuda_graphs, "CUDA graphs per forward size (--no-cuda-graphs: every "
                                                          "forward eagerly)", flag="--no-cuda-graphs",
                                action="negate", show_default=False, group="torch")
    engine: EngineSettings = field(default_factory=EngineSettings)

    @classmethod
    def load(cls, overrides: dict[str, Any], config_file: Path | None = None) -> Settings:
        """Defaults, then config.toml, then BASAL_LOCAL_* variables, then the given (CLI) overrides, each value
        checked against its declaration; errors are sentences naming where the value came from."""
        return load(overrides, config_file)

    def torch_options(self) -> TorchOptions:
        """The torch backend's options from the "torch" settings (the measuring knobs at their defaults)."""
        return torch_options({key: getattr(self, key) for key in torch_keys()})


def all_settings() -> list[tuple[str, Spec, Any, bool]]:
    """(key, spec, default, is_engine) of every declared setting."""
    return [(k, s, d, False) for k, s, d in declared(Settings)] + [(k, s, d, True) for k, s, d in declared(EngineSettings)]


def torch_keys() -> list[str]:
    """The settings of the group "torch": the product options of backends/torch/options.py."""
    return [key for key, spec, _, _ in all_settings() if spec.group == "torch"]


def torch_options(values: dict[str, Any]) -> TorchOptions:
    """TorchOptions from checked "torch" settings (a Settings' fields, or bench's flags; absent: the defaults)."""
    return TorchOptions.from_settings(**values)


def _unknown(path: Path, key: str, known: list[str]) -> ValueError:
    near = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ValueError(f"{path}: unknown setting {key!r}{hint}; the settings are: {', '.join(known)}")


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML ({exc}); fix or remove the file") from None


def file_values(path: Path, data: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings a config.toml gives (`data`: its parsed text, else the file is read), each checked against
    its declaration; ValueError names the file, the key and what is allowed (`basal-local config` uses it too)."""
    specs = {key: spec for key, spec, _, _ in all_settings()}
    out = {}
    for key, value in (_read_config(path) if data is None else data).items():
        if key not in specs:
            raise _unknown(path, key, list(specs))
        try:
            out[key] = check(key, specs[key], value)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    if not all(isinstance(v, str) for v in out.get("aliases", {}).values()):
        raise ValueError(f'{path}: [aliases] must map names to served model names (jev-latest = "mini")')
    if not all(isinstance(v, list) and all(isinstance(d, str) for d in v) for v in out.get("placement", {}).values()):
        raise ValueError(f'{path}: [placement] must map model names to lists of devices (mini = ["cuda:0"])')
    return out


def load(overrides: dict[str, Any], config_file: Path | None = None) -> Settings:
    path = config_file or config_path()
    specs = {key: (spec, engine) for key, spec, _, engine in all_settings()}
    settings = Settings()

    def put(key: str, value: Any, source: str, from_text: bool) -> None:
        spec, engine = specs[key]
        try:
            value = check(key, spec, value, from_text)
        except ValueError as exc:
            raise ValueError(f"{source}: {exc}") from None
        setattr(settings.engine if engine else settings, key, value)

    for key, value in file_values(path).items():
        setattr(settings.engine if specs[key][1] else settings, key, value)
    for key, (spec, _) in specs.items():
        if spec.env and os.environ.get(spec.env):  # an empty variable is unset (as the tools read the key)
            put(key, os.environ[spec.env], spec.env, from_text=True)
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in specs:
            raise ValueError(f"unknown setting {key!r}")
        spec, _ = specs[key]
        put(key, value, spec.flag or key, from_text=True)
    return settings


def config_path() -> Path:
    """Where `config.toml` is read from when --config is not given."""
    return home_dirs()["config"] / "config.toml"
