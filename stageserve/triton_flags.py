"""tritonserver's command-line flags that launch scripts carry, for `stageserve
up` and the gateway, parsed with tritonserver 2.51's rules and messages.

A Triton command line must start StageServe as it is. The flags fall in three
groups:

- aliases of flags StageServe has: `--id` (the name ServerMetadata answers,
  `--server-name`), `--model-store` (`--model-repository`), and
  `--strict-model-config` (deprecated in Triton: true is
  `--disable-auto-complete-config`);
- flags with an effect here: `--allow-metrics`, `--exit-timeout-secs`,
  `--backend-config` (its `default-max-batch-size`), `--allow-grpc` (true
  only), `--allow-sagemaker` / `--allow-vertex-ai` (false only),
  `--model-config-name`, `--metrics-address`, the header-forward patterns,
  the deprecated trace flags and
  `--response-cache-byte-size` (the `--trace-config` / `--cache-config`
  settings they stand for), and on `up` `--reuse-grpc-port` /
  `--reuse-http-port`;
- flags of Triton's own resources that StageServe has no counterpart for,
  type-checked as Triton checks them and otherwise without effect
  (`NO_EFFECT`, each with the reason; the README lists them).

Values: tritonserver's booleans (true/false, 1/0, on/off, yes/no), its
integers ("Invalid option value. Got x"), its pairs `<first>:<second>` and
its `--backend-config` format, each refused with tritonserver's message.
Standard library only, as the CLI's other option modules.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from stageserve.log_options import flag_bool

# What the gateway waits on shutdown for requests still in flight when the
# flag is not given; Triton's default is 30 s. StageServe keeps 5 (every
# stage's grace, service_runtime.run_server): a ModelStreamInfer stream a
# client keeps open holds a stopping gateway for the whole wait.
DEFAULT_EXIT_TIMEOUT_S = 5

_PINGS = (
    "the gateway's gRPC server answers every ping and finds a client gone without "
    "closing by TCP keepalive (~20 s)"
)
_NO_CLOUD = "no SageMaker or Vertex AI endpoint is served"

#: flag -> why it changes nothing in StageServe (accepted and type-checked)
NO_EFFECT: dict[str, str] = {
    "--pinned-memory-pool-byte-size": "no pinned host memory pool: tensors go "
    "between stages through shared memory",
    "--cuda-memory-pool-byte-size": "no CUDA memory pool: each backend allocates its "
    "device memory itself",
    "--min-supported-compute-capability": "GPUs are taken as the backends find them",
    "--buffer-manager-thread-count": "no buffer manager threads",
    "--http-thread-count": "the HTTP front runs on each gateway's event loop",
    "--grpc-infer-allocation-pool-size": "grpcio allocates its own messages",
    "--model-load-thread-count": "each worker loads its instances one model at a time",
    "--backend-directory": "the backends are part of StageServe",
    "--repoagent-directory": "repository agents are not supported",
    "--model-namespacing": "model names are unique in a repository",
    "--allow-gpu-metrics": "the gateway's metrics port serves what it has",
    "--allow-cpu-metrics": "the gateway's metrics port serves what it has",
    "--metrics-interval-ms": "metrics are read when scraped",
    "--metrics-config": "metrics keep StageServe's settings",
    "--grpc-keepalive-time": _PINGS,
    "--grpc-keepalive-timeout": _PINGS,
    "--grpc-keepalive-permit-without-calls": _PINGS,
    "--grpc-http2-max-pings-without-data": _PINGS,
    "--grpc-http2-min-recv-ping-interval-without-data": _PINGS,
    "--grpc-http2-max-ping-strikes": _PINGS,
    "--cache-directory": "the response cache is built in",
    "--cuda-virtual-address-size": "implicit sequence state lives in Redis",
    "--enable-peer-access": "GPUs are taken as the backends find them",
    "--host-policy": "instances are placed by the workers",
    "--model-load-gpu-limit": "loads are not limited by GPU memory use",
    "--sagemaker-port": _NO_CLOUD,
    "--sagemaker-safe-port-range": _NO_CLOUD,
    "--sagemaker-thread-count": _NO_CLOUD,
    "--vertex-ai-port": _NO_CLOUD,
    "--vertex-ai-thread-count": _NO_CLOUD,
    "--vertex-ai-default-model": _NO_CLOUD,
}
#: Triton's deprecated trace flags: each is one --trace-config setting.
DEPRECATED_TRACE = {
    "--trace-file": ("triton,file", "triton,file=<filepath>"),
    "--trace-level": ("level", "level=<OFF|TIMESTAMPS|TENSORS>"),
    "--trace-rate": ("rate", "rate=<rate value>"),
    "--trace-count": ("count", "count=<count value>"),
    "--trace-log-frequency": ("triton,log-frequency", "triton,log-frequency=<log frequency value>"),
}


def triton_int(text: str) -> int:
    """An integer option's value, as tritonserver parses it (std::stoi: the
    leading integer, so 7.5 is 7)."""
    match = _LEADING_INT.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"Invalid option value. Got {text}")
    return int(match.group(0))


def triton_float(text: str) -> float:
    match = _LEADING_FLOAT.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"Invalid option value. Got {text}")
    return float(match.group(0))


_LEADING_INT = re.compile(r"\s*[+-]?\d+")
_LEADING_FLOAT = re.compile(r"\s*[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def triton_pair(text: str, sep: str = ":") -> tuple[int, int]:
    """`<first>:<second>` of integers (--cuda-memory-pool-byte-size <gpu>:<bytes>)."""
    parts = text.split(sep)
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(
            "Cannot parse pair option due to incorrect number of inputs."
            f"--<pair option> argument requires format <first>{sep}<second>. Found: {text}"
        )
    return triton_int(parts[0]), triton_int(parts[1])


def triton_range(text: str) -> tuple[int, int]:
    """`<first>-<second>` (--sagemaker-safe-port-range)."""
    return triton_pair(text, "-")


def triton_fraction_pair(text: str) -> tuple[int, float]:
    """`<device>:<fraction>` (--model-load-gpu-limit)."""
    parts = text.split(":")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(
            "Cannot parse pair option due to incorrect number of inputs."
            f"--<pair option> argument requires format <first>:<second>. Found: {text}"
        )
    return triton_int(parts[0]), triton_float(parts[1])


def host_policy(text: str) -> str:
    """`<policy name>,<setting>=<value>`."""
    name, comma, pair = text.partition(",")
    if not comma or "=" not in pair:
        raise argparse.ArgumentTypeError(
            f"--host-policy option format is '<policy name>,<setting>=<value>'. Got {text}"
        )
    return text


def regex(text: str) -> str:
    """A header-forward pattern, compiled once here to refuse a bad one."""
    try:
        re.compile(text)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"invalid regular expression {text!r}: {exc}") from None
    return text


def config_name(text: str) -> str:
    """--model-config-name: a file name under configs/, without spaces."""
    if not text or any(c.isspace() for c in text) or "/" in text:
        raise argparse.ArgumentTypeError(
            f"--model-config-name must be a name without spaces or '/', got {text!r}"
        )
    return text


COMPRESSION_LEVELS = ("none", "low", "medium", "high")


def compression_level(text: str) -> str:
    if text not in COMPRESSION_LEVELS:
        raise argparse.ArgumentTypeError(
            "invalid argument for --grpc_infer_response_compression_level"
        )
    return text


TRACE_LEVELS = ("OFF", "TIMESTAMPS", "TENSORS")


def trace_level(text: str) -> str:
    if text.upper() not in TRACE_LEVELS:
        raise argparse.ArgumentTypeError(f"invalid value for trace level option: {text.lower()}")
    return text


def deprecated_configs(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """Triton's deprecated trace flags and --response-cache-byte-size as the
    --trace-config and --cache-config settings they stand for, with Triton's
    warning for each: (trace configs, cache configs), in the flags' order."""
    traces: list[str] = []
    for flag, (setting, form) in DEPRECATED_TRACE.items():
        values = getattr(args, flag[2:].replace("-", "_"), None) or []
        for value in values:
            print(
                f"Warning: '{flag}' has been deprecated and will be removed in future "
                f"releases. Please use '--trace-config {form} instead.",
                file=sys.stderr,
            )
            traces.append(f"{setting}={value}")
    caches: list[str] = []
    size = getattr(args, "response_cache_byte_size", None)
    if size is not None:
        print(
            "Warning: '--response-cache-byte-size' has been deprecated! This will default "
            "to the 'local' cache implementation with the provided byte size for its "
            "config. Please use '--cache-config' instead. The equivalent --cache-config CLI "
            f"args would be: '--cache-config=local,size={size}'",
            file=sys.stderr,
        )
        caches.append(f"local,size={size}")
    return traces, caches


@dataclass(frozen=True)
class BackendConfig:
    """One --backend-config: `backend` is "" for a global setting."""

    backend: str
    setting: str
    value: str


def backend_config(text: str) -> BackendConfig:
    """`<backend name>,<setting>=<value>`, or `<setting>=<value>` for every
    backend, as tritonserver takes it."""
    head, comma, rest = text.partition(",")
    backend, pair = (head, rest) if comma else ("", head)
    if comma and not backend:
        raise argparse.ArgumentTypeError(
            "No backend specified. --backend-config option format is <backend name>,"
            f"<setting>=<value> or <setting>=<value>. Got {text}"
        )
    setting, eq, value = pair.partition("=")
    if not eq or not setting or not value:
        raise argparse.ArgumentTypeError(
            f"--backend-config option format is '<backend name>,<setting>=<value>'. Got {text}"
        )
    return BackendConfig(backend, setting, value)


def _applied(c: BackendConfig) -> bool:
    """The one setting StageServe applies: `default-max-batch-size` for every
    backend or for onnxruntime (the one backend whose configs it auto-completes)."""
    return c.setting == "default-max-batch-size" and c.backend in ("", "onnxruntime")


def default_max_batch_size(configs: Iterable[BackendConfig]) -> int | None:
    """The last applied `default-max-batch-size` given (`_applied`)."""
    found = None
    for c in configs:
        if _applied(c):
            try:
                found = int(c.value)
            except ValueError:
                raise ValueError(
                    f"--backend-config default-max-batch-size must be an integer, got {c.value!r}"
                ) from None
    return found


def unused_backend_configs(configs: Sequence[BackendConfig]) -> list[str]:
    """The given configs StageServe does not apply, as they were written."""
    return [
        f"{c.backend + ',' if c.backend else ''}{c.setting}={c.value}"
        for c in configs
        if not _applied(c)
    ]


def add_triton_flags(p: argparse.ArgumentParser) -> None:
    """The flags above, on `up` or the gateway (which already has
    --model-repository, --server-name and --disable-auto-complete-config)."""
    p.add_argument("--id", dest="server_name", help="as tritonserver's: same as --server-name")
    p.add_argument(
        "--model-store", dest="model_repository", type=Path, help="as --model-repository"
    )
    for flag, default, what in (
        ("--strict-model-config", None, "deprecated in Triton: true is "
         "--disable-auto-complete-config"),
        ("--allow-metrics", True, "false: no Triton metrics port (as tritonserver)"),
        ("--allow-grpc", True, "true only: the gateways always serve gRPC (the stack's own "
         "readiness uses it)"),
        ("--allow-sagemaker", False, "false only: no SageMaker endpoint is served"),
        ("--allow-vertex-ai", False, "false only: no Vertex AI endpoint is served"),
    ):  # fmt: skip
        p.add_argument(flag, type=flag_bool, nargs="?", const=True, default=default, help=what)
    p.add_argument(
        "--exit-timeout-secs",
        type=triton_int,
        default=None,
        help="on shutdown, how long a gateway waits for requests in flight "
        f"(default {DEFAULT_EXIT_TIMEOUT_S}; Triton's is 30)",
    )
    p.add_argument(
        "--backend-config",
        type=backend_config,
        action="append",
        default=[],
        help="<backend>,<setting>=<value> or <setting>=<value>; StageServe applies "
        "default-max-batch-size (global or onnxruntime) and logs the others as unused",
    )
    for flag, kind, repeat in (
        ("--pinned-memory-pool-byte-size", triton_int, False),
        ("--cuda-memory-pool-byte-size", triton_pair, True),
        ("--min-supported-compute-capability", triton_float, False),
        ("--buffer-manager-thread-count", triton_int, False),
        ("--http-thread-count", triton_int, False),
        ("--grpc-infer-allocation-pool-size", triton_int, False),
        ("--model-load-thread-count", triton_int, False),
        ("--backend-directory", str, False),
        ("--repoagent-directory", str, False),
        ("--model-namespacing", flag_bool, False),
        ("--allow-gpu-metrics", flag_bool, False),
        ("--allow-cpu-metrics", flag_bool, False),
        ("--metrics-interval-ms", triton_int, False),
        ("--metrics-config", str, True),
        ("--grpc-keepalive-time", triton_int, False),
        ("--grpc-keepalive-timeout", triton_int, False),
        ("--grpc-keepalive-permit-without-calls", flag_bool, False),
        ("--grpc-http2-max-pings-without-data", triton_int, False),
        ("--grpc-http2-min-recv-ping-interval-without-data", triton_int, False),
        ("--grpc-http2-max-ping-strikes", triton_int, False),
        ("--cache-directory", str, False),
        ("--cuda-virtual-address-size", triton_pair, True),
        ("--enable-peer-access", flag_bool, False),
        ("--host-policy", host_policy, True),
        ("--model-load-gpu-limit", triton_fraction_pair, True),
        ("--sagemaker-port", triton_int, False),
        ("--sagemaker-safe-port-range", triton_range, False),
        ("--sagemaker-thread-count", triton_int, False),
        ("--vertex-ai-port", triton_int, False),
        ("--vertex-ai-thread-count", triton_int, False),
        ("--vertex-ai-default-model", str, False),
    ):
        p.add_argument(
            flag,
            type=kind,
            action="append" if repeat else "store",
            default=[] if repeat else None,
            help=f"accepted, no effect: {NO_EFFECT[flag]}",
        )

    p.add_argument(
        "--model-config-name",
        type=config_name,
        default=None,
        help="as tritonserver: a model's configs/<name>.pbtxt is read instead of its "
        "config.pbtxt where it has one",
    )
    for flag, what in (
        ("--grpc-max-connection-age", "how long a client connection may live, in ms: then "
         "the gateway ends it (GOAWAY) once its calls finish; unset: no limit"),
        ("--grpc-max-connection-age-grace", "how long calls in flight on such a connection "
         "may go on, in ms; unset: until they finish"),
    ):  # fmt: skip
        p.add_argument(flag, type=triton_int, default=None, help=f"as tritonserver: {what}")
    p.add_argument(
        "--model-load-retry-count",
        type=triton_int,
        default=None,
        help="as tritonserver: how many times a model load that fails is tried again (default 0)",
    )
    p.add_argument(
        "--grpc-infer-response-compression-level",
        type=compression_level,
        default=None,
        help="as tritonserver: none, low, medium or high; ModelInfer and ModelStreamInfer "
        "answers are compressed with gzip or deflate as the client accepts (StageServe's "
        "own gRPC server, the default front; grpcio's front leaves them uncompressed)",
    )
    for flag in ("--grpc-header-forward-pattern", "--http-header-forward-pattern"):
        p.add_argument(
            flag,
            type=regex,
            default=None,
            help="as tritonserver: request headers whose name matches this regular "
            "expression become string parameters of the inference request",
        )
    p.add_argument(
        "--metrics-address",
        default=None,
        help="the address the Triton metrics port binds (default 0.0.0.0)",
    )
    p.add_argument(
        "--response-cache-byte-size",
        type=triton_int,
        default=None,
        help="deprecated in Triton: --cache-config=local,size=<bytes>",
    )
    for flag, (_, form) in DEPRECATED_TRACE.items():
        p.add_argument(
            flag,
            type=trace_level if flag == "--trace-level" else str,
            action="append",
            default=[],
            help=f"deprecated in Triton: --trace-config {form}",
        )


def refused(args: argparse.Namespace) -> str | None:
    """Why a Triton flag given cannot be served, or None."""
    if not getattr(args, "allow_grpc", True):
        return (
            "--allow-grpc=false is not supported: StageServe's gateways always serve "
            "gRPC (the stack's own readiness checks use it)"
        )
    for flag in ("allow_sagemaker", "allow_vertex_ai"):
        if getattr(args, flag, False):
            name = "--" + flag.replace("_", "-")
            return f"{name}=true is not supported: StageServe serves no such endpoint"
    return None


def ignored(args: argparse.Namespace) -> list[str]:
    """The no-effect flags given, with why each changes nothing."""
    given = []
    for flag, why in NO_EFFECT.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value not in (None, []):
            given.append(f"{flag} ({why})")
    return given
