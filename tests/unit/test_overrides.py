"""services/gateway/overrides.py: load overrides land in the override area only, and
each folder lives as long as the load it serves."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from services.gateway.overrides import OverrideArea
from stageserve.errors import StageError
from stageserve.generated import grpc_service_pb2 as gs
from stageserve_tools.examples import write_simple


def params(config: str | None = None, **files: bytes) -> dict[str, gs.ModelRepositoryParameter]:
    out = {}
    if config is not None:
        out["config"] = gs.ModelRepositoryParameter(string_param=config)
    for path, data in files.items():
        out[f"file:{path}"] = gs.ModelRepositoryParameter(bytes_param=data)
    return out


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_simple(tmp_path / "repo", "simple")
    return tmp_path / "repo"


def test_no_override_is_no_folder(tmp_path: Path, repo: Path) -> None:
    area = OverrideArea(tmp_path / "area")
    assert area.prepare("simple", {}, repo) is None


def test_config_override_links_the_repository_versions(tmp_path: Path, repo: Path) -> None:
    (tmp_path / "area").mkdir()
    area = OverrideArea(tmp_path / "area")
    root = area.prepare("simple", params(json.dumps({"max_batch_size": 2})), repo)
    assert root is not None and root.parent == tmp_path / "area"
    model = root / "simple"
    assert "max_batch_size: 2" in (model / "config.pbtxt").read_text()
    assert (model / "1").resolve() == (repo / "simple" / "1").resolve()
    assert "max_batch_size: 8" in (repo / "simple" / "config.pbtxt").read_text()


def test_file_override_writes_inside_its_folder(tmp_path: Path, repo: Path) -> None:
    (tmp_path / "area").mkdir()
    area = OverrideArea(tmp_path / "area")
    config = json.dumps({"name": "fresh", "max_batch_size": 2})
    root = area.prepare("fresh", params(config, **{"1/model.onnx": b"onnx"}), repo)
    assert root is not None
    assert (root / "fresh" / "1" / "model.onnx").read_bytes() == b"onnx"
    assert sorted(p.name for p in repo.iterdir()) == ["simple"]


def test_folders_go_when_replaced_unloaded_or_failed(tmp_path: Path, repo: Path) -> None:
    (tmp_path / "area").mkdir()
    area = OverrideArea(tmp_path / "area")
    first = area.prepare("simple", params("{}"), repo)
    area.settle("simple", first, loaded=True)
    second = area.prepare("simple", params("{}"), repo)
    area.settle("simple", second, loaded=True)  # a newer load replaces the first
    assert first is not None and not first.exists() and second is not None and second.exists()
    failed = area.prepare("simple", params("{}"), repo)
    area.settle("simple", failed, loaded=False)  # a failed load keeps the serving one
    assert failed is not None and not failed.exists() and second.exists()
    area.settle("simple", None, loaded=True)  # unloaded (or reloaded from the repository)
    assert not second.exists()
    assert list((tmp_path / "area").iterdir()) == []


def test_an_owned_area_is_removed_on_close(repo: Path) -> None:
    area = OverrideArea()
    root = area.prepare("simple", params("{}"), repo)
    area.settle("simple", root, loaded=True)
    area.close()
    assert not area.root.exists()


@pytest.mark.parametrize(
    ("parameters", "reason"),
    [
        (params(None, **{"1/model.onnx": b"x"}), "'config' must be specified"),
        (params("{", **{}), "Invalid config override"),
        (params(json.dumps({"name": "other"})), "directory name must equal model name"),
        (params("{}", **{"../x": b"x"}), "must stay within model directory"),
        (params("{}", **{"/etc/x": b"x"}), "must stay within model directory"),
        (params("{}", **{"1/" + "x" * 256: b"x"}), "file name too long"),
        ({"foo": gs.ModelRepositoryParameter(bool_param=True)}, "unknown load parameters"),
        ({"config": gs.ModelRepositoryParameter(int64_param=1)}, "must be a string"),
    ],
)
def test_refusals(tmp_path: Path, repo: Path, parameters, reason: str) -> None:
    (tmp_path / "area").mkdir()
    area = OverrideArea(tmp_path / "area")
    with pytest.raises(StageError) as info:
        area.prepare("simple", parameters, repo)
    assert info.value.code == grpc.StatusCode.INTERNAL  # Triton 2.51: a refused load
    assert reason in info.value.message
    assert list((tmp_path / "area").iterdir()) == []
