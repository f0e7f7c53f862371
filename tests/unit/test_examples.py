"""The generated example repository: layout, configs, and every model's numbers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from services.worker.backends import BackendError
from services.worker.onnx_backend import OnnxInstance
from stageserve.config import parse_config_text, to_spec
from stageserve.datatypes import from_triton
from stageserve.tensors import numpy_to_raw, raw_to_numpy
from stageserve_tools import examples

REPO_ROOT = Path(__file__).resolve().parents[2]

PYTHON_MODELS = {"py_preprocess", "py_bls", "py_stream"}  # model.py (Python backend)
EXPECTED_MODELS = {
    "simple",
    "simple_nobatch",
    "bench_identity",
    "mlp",
    "accumulator",
    "ragged_sum",
    "preprocess",
    "ensemble_mlp",
    *(f"identity_{d.lower()}" for d in examples.ALL_DATATYPES),
    *PYTHON_MODELS,
    "ensemble_py_mlp",
    "torch_mlp",  # TorchScript (stageserve_tools.torch_examples; torch is a test dependency)
    "torch_two_io",
}
# Ensembles have a config and an empty version folder, no model file.
ONNX_MODELS = EXPECTED_MODELS - {
    "ensemble_mlp",
    "ensemble_py_mlp",
    *PYTHON_MODELS,
    "torch_mlp",
    "torch_two_io",
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("model_repository")
    names = examples.build_example_repository(root)
    assert set(names) == EXPECTED_MODELS
    assert len(names) == len(set(names))
    return root


def _model(repo: Path, name: str) -> Path:
    return repo / name / "1" / "model.onnx"


# --------------------------------------------------------------------------
# layout and configs


def test_layout(repo: Path) -> None:
    assert {p.name for p in repo.iterdir()} == EXPECTED_MODELS
    for name in ONNX_MODELS:
        assert (repo / name / "config.pbtxt").is_file()
        assert _model(repo, name).is_file()
    for name in PYTHON_MODELS:
        assert (repo / name / "1" / "model.py").is_file()
        assert to_spec(parse_config_text((repo / name / "config.pbtxt").read_text())).backend == (
            "python"
        )
    everything = "BOOL UINT8 UINT16 UINT32 UINT64 INT8 INT16 INT32 INT64 FP16 FP32 FP64 BF16 BYTES"
    assert tuple(everything.split()) == examples.ALL_DATATYPES


def test_models_pass_onnx_checker_with_pinned_opset(repo: Path) -> None:
    for name in ONNX_MODELS:
        m = onnx.load(str(_model(repo, name)))
        onnx.checker.check_model(m)
        assert m.ir_version == examples.IR_VERSION
        assert [(o.domain, o.version) for o in m.opset_import] == [("", examples.OPSET)]


def test_mlp_file_size_reasonable(repo: Path) -> None:
    size = _model(repo, "mlp").stat().st_size
    # (256*1024 + 1024*1024 + 1024*10 + biases) float32 weights, about 5.3 MB
    assert 5_000_000 < size < 6_000_000


def test_build_is_deterministic(tmp_path: Path, repo: Path) -> None:
    examples.write_mlp(tmp_path, "mlp", instance_count=2)
    assert _model(tmp_path, "mlp").read_bytes() == _model(repo, "mlp").read_bytes()
    assert (tmp_path / "mlp" / "config.pbtxt").read_text() == (
        repo / "mlp" / "config.pbtxt"
    ).read_text()


def test_write_model_versions(tmp_path: Path) -> None:
    m = examples.identity_model("INT32")
    text = examples.config_text(
        "multi", [("INPUT0", "INT32", (-1,))], [("OUTPUT0", "INT32", (-1,))], max_batch_size=4
    )
    d = examples.write_model(tmp_path, "multi", m, text, versions=(1, 3))
    assert sorted(p.name for p in d.iterdir()) == ["1", "3", "config.pbtxt"]
    assert (d / "3" / "model.onnx").read_bytes() == m.SerializeToString()


def test_main_cli(tmp_path: Path) -> None:
    out = tmp_path / "cli_repo"
    proc = subprocess.run(
        [sys.executable, "-m", "stageserve_tools.examples", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in out.iterdir()} == EXPECTED_MODELS


@pytest.fixture(scope="module")
def model_config_cls(tmp_path_factory: pytest.TempPathFactory):
    """inference.ModelConfig built from protos/model_config.proto in a private pool."""
    protoc = pytest.importorskip("grpc_tools.protoc")
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto_dir = REPO_ROOT / "protos"
    if not (proto_dir / "model_config.proto").is_file():
        pytest.skip("protos/model_config.proto not present")
    out = tmp_path_factory.mktemp("desc") / "model_config.desc"
    rc = protoc.main(
        [
            "protoc",
            f"-I{proto_dir}",
            f"--descriptor_set_out={out}",
            "--include_imports",
            "model_config.proto",
        ]
    )
    assert rc == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:
        pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("inference.ModelConfig"))


def _parse_config(cls, path: Path):
    from google.protobuf import text_format

    return text_format.Parse(path.read_text(), cls())


def test_configs_parse_and_match_models(repo: Path, model_config_cls) -> None:
    """Every config.pbtxt parses as a ModelConfig and agrees with its ONNX file."""
    for name in ONNX_MODELS:
        cfg = _parse_config(model_config_cls, repo / name / "config.pbtxt")
        assert cfg.name == name
        assert cfg.platform == "onnxruntime_onnx"
        enum = (
            cfg.DESCRIPTOR.fields_by_name["input"]
            .message_type.fields_by_name["data_type"]
            .enum_type
        )
        in_types = {i.name: enum.values_by_number[i.data_type].name for i in cfg.input}
        out_types = {o.name: enum.values_by_number[o.data_type].name for o in cfg.output}
        # Sequence models also take control and state tensors the scheduler fills.
        spec = to_spec(parse_config_text((repo / name / "config.pbtxt").read_text()))
        states = spec.sequence.states if spec.sequence else ()
        inst = OnnxInstance(
            _model(repo, name),
            "cpu",
            1,
            {**{n: _triton(t) for n, t in in_types.items()}, **spec.extra_inputs()},
            {
                **{n: _triton(t) for n, t in out_types.items()},
                **{st.output_name: st.datatype.triton for st in states},
            },
        )
        desc = inst.describe()
        batch = [-1] if cfg.max_batch_size > 0 else []
        # Ragged inputs and scattered outputs are 1-D in the model (every
        # request's elements); batch inputs have shapes of their own.
        flat = spec.ragged_inputs | {t for b in spec.batch_outputs for t in b.target_names}
        for tensors, infos in ((cfg.input, desc.inputs), (cfg.output, desc.outputs)):
            by_name = {t.name: t for t in infos}
            for t in tensors:
                want = [-1] if t.name in flat else batch + list(t.dims)
                assert list(by_name[t.name].shape) == want, (name, t.name)
            if cfg.max_batch_size > 0:
                batched = [i for i in infos if i.name in {t.name for t in tensors} - flat]
                assert all(i.dim_names[0] == "batch" for i in batched)


def test_config_details(repo: Path, model_config_cls) -> None:
    def cfg(name):
        return _parse_config(model_config_cls, repo / name / "config.pbtxt")

    simple = cfg("simple")
    assert simple.max_batch_size == 8
    assert simple.HasField("dynamic_batching")
    assert [i.name for i in simple.input] == ["INPUT0", "INPUT1"]
    assert [o.name for o in simple.output] == ["OUTPUT0", "OUTPUT1"]
    assert all(list(t.dims) == [16] for t in [*simple.input, *simple.output])

    nob = cfg("simple_nobatch")
    assert nob.max_batch_size == 0
    assert not nob.HasField("dynamic_batching")
    assert all(list(t.dims) == [1, 16] for t in [*nob.input, *nob.output])

    mlp = cfg("mlp")
    assert mlp.max_batch_size == 64 and mlp.HasField("dynamic_batching")
    assert list(mlp.input[0].dims) == [256] and list(mlp.output[0].dims) == [10]
    assert mlp.instance_group[0].count == 2

    bench = cfg("bench_identity")
    assert bench.max_batch_size == 64 and list(bench.input[0].dims) == [16]

    for d in examples.ALL_DATATYPES:
        c = cfg(f"identity_{d.lower()}")
        assert c.max_batch_size == 64 and c.HasField("dynamic_batching")
        assert list(c.input[0].dims) == [-1]
        enum = c.DESCRIPTOR.fields_by_name["input"].message_type.fields_by_name["data_type"]
        for t in (c.input[0], c.output[0]):
            assert enum.enum_type.values_by_number[t.data_type].name == from_triton(d).config_enum
    assert "TYPE_STRING" in (repo / "identity_bytes" / "config.pbtxt").read_text()
    assert "TYPE_BF16" in (repo / "identity_bf16" / "config.pbtxt").read_text()


def _triton(config_enum: str) -> str:
    from stageserve.datatypes import from_config_enum

    return from_config_enum(config_enum).triton


# --------------------------------------------------------------------------
# numbers


def test_simple_add_sub(repo: Path) -> None:
    inst = OnnxInstance(
        _model(repo, "simple"),
        "cpu",
        1,
        {"INPUT0": "INT32", "INPUT1": "INT32"},
        {"OUTPUT0": "INT32", "OUTPUT1": "INT32"},
    )
    rng = np.random.default_rng(0)
    for batch in (1, 3, 8, 20):  # the symbolic batch dim takes any size
        a = rng.integers(-1000, 1000, (batch, 16), dtype=np.int32)
        b = rng.integers(-1000, 1000, (batch, 16), dtype=np.int32)
        out = inst.run({"INPUT0": a, "INPUT1": b}, ["OUTPUT0", "OUTPUT1"])
        assert out["OUTPUT0"].dtype == np.int32 and out["OUTPUT0"].shape == (batch, 16)
        np.testing.assert_array_equal(out["OUTPUT0"], a + b)
        np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    # Triton's simple client: INPUT0 = 0..15, INPUT1 = ones
    a = np.arange(16, dtype=np.int32)[None]
    b = np.ones((1, 16), dtype=np.int32)
    out = inst.run({"INPUT0": a, "INPUT1": b}, ["OUTPUT1"])
    assert list(out) == ["OUTPUT1"]
    np.testing.assert_array_equal(out["OUTPUT1"][0], np.arange(-1, 15))


def test_simple_nobatch(repo: Path) -> None:
    inst = OnnxInstance(
        _model(repo, "simple_nobatch"),
        "cpu",
        1,
        {"INPUT0": "INT32", "INPUT1": "INT32"},
        {"OUTPUT0": "INT32", "OUTPUT1": "INT32"},
    )
    assert [t.shape for t in inst.describe().inputs] == [(1, 16), (1, 16)]
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 7, dtype=np.int32)
    out = inst.run({"INPUT0": a, "INPUT1": b}, ["OUTPUT0", "OUTPUT1"])
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    with pytest.raises(BackendError):  # no batch dim: [2, 16] is not [1, 16]
        inst.run({"INPUT0": np.zeros((2, 16), np.int32), "INPUT1": np.zeros((2, 16), np.int32)})


def _identity_values(datatype: str, rng: np.random.Generator) -> np.ndarray:
    """A (batch, n) array of awkward values for ``datatype`` (shared representation)."""
    if datatype == "BOOL":
        return rng.integers(0, 2, (4, 33)).astype(bool)
    if datatype == "BYTES":
        items = [
            b"",
            b"plain ascii",
            "héllo wörld".encode(),
            "日本語テキスト".encode(),
            "🙂👍🏽".encode(),
            b"nul\x00inside",
            b"\x00",
            b"trailing nul\x00",
            b"x" * 5000,
            "\u00a0\u200b".encode(),  # no-break space, zero-width space
        ]
        arr = np.empty(len(items) * 2, dtype=object)
        arr[:] = items + items[::-1]
        return arr.reshape(2, len(items))
    if datatype in ("FP16", "BF16"):
        # every 16-bit pattern: NaN payloads, infinities, -0.0, subnormals
        words = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).reshape(64, 1024)
        return words.view(np.float16) if datatype == "FP16" else words
    dt = from_triton(datatype).numpy
    assert dt is not None
    if dt.kind in "iu":
        info = np.iinfo(dt)
        edge = np.array([info.min, info.max, 0, 1, info.max - 1, info.min + 1], dtype=dt)
        body = rng.integers(info.min, info.max, (3, 30), dtype=dt, endpoint=True)
        return np.concatenate([body.reshape(-1), edge]).reshape(3, 32)
    f = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-300, 3.5], dtype=np.float64)
    with np.errstate(over="ignore", under="ignore"):
        edge = f.astype(dt)
    body = rng.standard_normal(24).astype(dt)
    return np.concatenate([edge, body]).reshape(2, 16)


def _bits(a: np.ndarray) -> np.ndarray:
    if a.dtype.kind == "f":
        return a.view(f"u{a.dtype.itemsize}")
    return a


@pytest.mark.parametrize("datatype", examples.ALL_DATATYPES)
def test_identity_round_trip(repo: Path, datatype: str) -> None:
    name = f"identity_{datatype.lower()}"
    inst = OnnxInstance(_model(repo, name), "cpu", 1, {"INPUT0": datatype}, {"OUTPUT0": datatype})
    rng = np.random.default_rng(sum(datatype.encode()))
    x = _identity_values(datatype, rng)
    # what a worker does: raw request bytes -> shared numpy -> model -> raw response bytes
    dt = from_triton(datatype)
    raw_in = numpy_to_raw(x, dt)
    fed = raw_to_numpy(raw_in, datatype, x.shape)
    out = inst.run({"INPUT0": fed}, ["OUTPUT0"])["OUTPUT0"]
    assert out.shape == x.shape
    if datatype == "BYTES":
        assert out.dtype == object
        assert all(type(v) is bytes for v in out.reshape(-1))
        assert out.tolist() == x.tolist()
    else:
        assert out.dtype == dt.numpy
        np.testing.assert_array_equal(_bits(out), _bits(x))
    assert numpy_to_raw(out, dt) == raw_in
    # a batch of one with a single element, and a wider second dim
    one = x.reshape(-1)[:1].reshape(1, 1)
    out1 = inst.run({"INPUT0": one}, ["OUTPUT0"])["OUTPUT0"]
    assert numpy_to_raw(out1, dt) == numpy_to_raw(one, dt)


def test_bench_identity(repo: Path) -> None:
    inst = OnnxInstance(
        _model(repo, "bench_identity"), "cpu", 1, {"INPUT0": "FP32"}, {"OUTPUT0": "FP32"}
    )
    x = np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)
    np.testing.assert_array_equal(inst.run({"INPUT0": x}, ["OUTPUT0"])["OUTPUT0"], x)


def test_mlp(repo: Path) -> None:
    inst = OnnxInstance(_model(repo, "mlp"), "cpu", 2, {"INPUT0": "FP32"}, {"OUTPUT0": "FP32"})
    rng = np.random.default_rng(7)
    n = 16
    x = rng.standard_normal((n, 256)).astype(np.float32)
    probs = inst.run({"INPUT0": x}, ["OUTPUT0"])["OUTPUT0"]
    assert probs.shape == (n, 10) and probs.dtype == np.float32
    assert np.all(probs >= 0)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0, rtol=0, atol=1e-5)
    # agrees with a float64 numpy forward pass of the same seeded weights
    ref = examples.mlp_reference(x, examples.mlp_weights())
    np.testing.assert_allclose(probs, ref, rtol=1e-3, atol=1e-5)
    # not degenerate: different rows pick different classes, none is one-hot
    assert len(set(probs.argmax(axis=1).tolist())) > 1
    assert probs.max() < 0.9999
    # a batch of N equals N single runs
    singles = np.concatenate([inst.run({"INPUT0": x[i : i + 1]})["OUTPUT0"] for i in range(n)])
    np.testing.assert_allclose(probs, singles, rtol=1e-5, atol=1e-6)
    # max batch size runs too
    big = rng.standard_normal((64, 256)).astype(np.float32)
    assert inst.run({"INPUT0": big})["OUTPUT0"].shape == (64, 10)
