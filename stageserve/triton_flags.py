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
  only), and on `up` `--reuse-grpc-port` / `--reuse-http-port`;
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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from stageserve.log_options import flag_bool

# What the gateway waits on shutdown for requests still in flight when the
# flag is not given; Triton's default is 30 s. StageServe keeps 5 (every
# stage's grace, service_runtime.run_server): a ModelStreamInfer stream a
# client keeps open holds a stopping gateway for the whole wait.
DEFAULT_EXIT_TIMEOUT_S = 5

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


def triton_pair(text: str) -> tuple[int, int]:
    """`<first>:<second>` of integers (--cuda-memory-pool-byte-size <gpu>:<bytes>)."""
    parts = text.split(":")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(
            "Cannot parse pair option due to incorrect number of inputs."
            f"--<pair option> argument requires format <first>:<second>. Found: {text}"
        )
    return triton_int(parts[0]), triton_int(parts[1])


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
    ):
        p.add_argument(
            flag,
            type=kind,
            action="append" if repeat else "store",
            default=[] if repeat else None,
            help=f"accepted, no effect: {NO_EFFECT[flag]}",
        )


def ignored(args: argparse.Namespace) -> list[str]:
    """The no-effect flags given, with why each changes nothing."""
    given = []
    for flag, why in NO_EFFECT.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value not in (None, []):
            given.append(f"{flag} ({why})")
    return given
