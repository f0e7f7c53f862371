"""bench/batch_shapes.py: each variant's config.pbtxt parses to the padding
and shape warm-up it stands for."""

from __future__ import annotations

from pathlib import Path

from bench.batch_shapes import variant_config, warmup_entry
from bench.cnn import write_cnn
from services.worker.shape_warmup import warmup_shapes
from stageserve.config import parse_config_text, to_spec
from stageserve.pad_policy import ON, PadPolicy


def _spec(tmp_path: Path, variant: str):
    model_dir = write_cnn(tmp_path / variant, image_size=8, width=4, max_batch_size=32)
    text = variant_config((model_dir / "config.pbtxt").read_text(), variant, 32)
    return to_spec(parse_config_text(text))


def test_each_variant_pads_and_warms_up_as_named(tmp_path: Path) -> None:
    plain, pad, cold = (_spec(tmp_path, v) for v in ("plain", "pad", "cold"))
    assert plain.pad_batch == PadPolicy() and cold.pad_batch == PadPolicy()
    assert pad.pad_batch == PadPolicy(ON, (1, 2, 4, 8, 16, 32))
    assert pad.dynamic_batching is not None
    assert pad.dynamic_batching.preferred_batch_sizes == (1, 2, 4, 8, 16, 32)
    assert warmup_shapes(plain, on_gpu=True, pad_sizes=()) == tuple(range(1, 33))
    assert warmup_shapes(cold, on_gpu=True, pad_sizes=()) == ()


def test_warmup_entry_reads_the_workers_line_in_either_format(tmp_path: Path) -> None:
    log = tmp_path / "stack.log"
    assert warmup_entry(log) == {}
    fields = '{"model": "cnn", "shapes": [1, 2], "seconds": 0.5}'
    log.write_text(f"2026 I 1 worker services.worker.hosting:90] shape warm-up done {fields}\n")
    assert warmup_entry(log) == {"model": "cnn", "shapes": [1, 2], "seconds": 0.5}
    log.write_text('{"msg": "shape warm-up done", "seconds": 1.0}\n')
    assert warmup_entry(log)["seconds"] == 1.0
