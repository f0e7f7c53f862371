"""stageserve/grpc_io.py: the gRPC I/O path is chosen before grpc loads, unless the user chose."""

import subprocess
import sys

from stageserve.grpc_io import GRPC_EXPERIMENTS, choose_grpc_io


def test_sets_the_experiments_when_unset():
    env: dict[str, str] = {}
    assert choose_grpc_io(env) == GRPC_EXPERIMENTS
    assert env == {"GRPC_EXPERIMENTS": GRPC_EXPERIMENTS}


def test_a_user_value_wins():
    env = {"GRPC_EXPERIMENTS": "event_engine_client"}
    assert choose_grpc_io(env) == "event_engine_client"


def test_the_cli_chooses_before_grpc_is_imported():
    """`python -m stageserve.cli` must not have imported grpc by the time main() runs."""
    code = (
        "import sys, os; os.environ.pop('GRPC_EXPERIMENTS', None);"
        "import stageserve.cli as cli; assert 'grpc' not in sys.modules;"
        "from stageserve.grpc_io import choose_grpc_io; print(choose_grpc_io())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == GRPC_EXPERIMENTS
