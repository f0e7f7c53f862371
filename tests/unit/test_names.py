"""stageserve.names: what may reach the file system, with Triton's codes and messages."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from stageserve.errors import StageError
from stageserve.names import (
    MAX_NAME_BYTES,
    check_model_name,
    check_override_path,
    check_shm_key,
    model_dir,
    model_name_problem,
    override_path_problem,
    parse_version,
    printable,
)

HOSTILE = ["a/b", "..", ".", "../x", "/etc", "a\x00b", "x" * 256, "", ".hidden", "a\\b", "a\nb"]


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_model_names_are_refused_with_tritons_codes(name: str) -> None:
    """A load refused answers INTERNAL (Triton 2.51: "failed to poll from model
    repository"); any other action INVALID_ARGUMENT."""
    assert model_name_problem(name) is not None
    for action, code in (
        ("load", grpc.StatusCode.INTERNAL),
        ("unload", grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(StageError) as info:
            check_model_name(name, action)
        assert info.value.code == code
        assert info.value.message.startswith(f"failed to {action} ")
        assert "\x00" not in info.value.message and len(info.value.message) < 400


def test_override_path_problems_name_the_cause() -> None:
    assert override_path_problem("1/model.onnx") is None
    assert override_path_problem("1/" + "x" * MAX_NAME_BYTES) is None
    too_long = override_path_problem("1/" + "x" * (MAX_NAME_BYTES + 1))
    assert too_long is not None and "file name too long" in too_long
    for outside in ("../x", "/etc/passwd", "a\x00b", ""):
        problem = override_path_problem(outside)
        assert problem is not None and "must stay within model directory" in problem


@pytest.mark.parametrize("name", ["simple", "x" * MAX_NAME_BYTES, "ensemble-mlp_2", "modèle"])
def test_ordinary_names_pass_and_stay_inside_the_root(name: str, tmp_path: Path) -> None:
    check_model_name(name)
    assert model_dir(tmp_path, name).parent == tmp_path


def test_versions_as_triton_parses_them() -> None:
    assert parse_version("") is None
    assert parse_version("3") == 3 and parse_version("0") == 0
    for text in ("abc", "1/..", " 1", "9" * 30, "1_0", "١"):
        with pytest.raises(StageError) as info:
            parse_version(text)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "version should be an integral value > 0" in info.value.message
    with pytest.raises(StageError, match="invalid model version specified '-1'"):
        parse_version("-1")


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "1/../../x", "a\x00b", "", "./x", "a\\b"])
def test_override_paths_outside_the_model_folder_are_refused(path: str) -> None:
    with pytest.raises(StageError) as info:
        check_override_path(path)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_override_paths_inside_the_model_folder_pass() -> None:
    assert str(check_override_path("1/model.onnx")) == "1/model.onnx"


def test_shm_keys_name_one_object() -> None:
    err = StageError(grpc.StatusCode.INTERNAL, "cannot open")
    assert check_shm_key("/region_1", err) == "region_1"
    for key in ("/../etc/passwd", "/a/b", "/", "", "/..", "/x\x00", "/" + "k" * 300):
        with pytest.raises(StageError) as info:
            check_shm_key(key, err)
        assert info.value is err


def test_names_in_messages_are_escaped_only_where_unprintable() -> None:
    assert printable("modèle") == "modèle"
    assert printable("a\x00b\nc") == "a\\x00b\\nc"
    assert printable("x" * 1000).endswith("...(1000 chars)")
