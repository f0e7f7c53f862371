"""stageserve/stage_tls.py: all three settings or none; unreadable files named."""

from pathlib import Path

import pytest

from stageserve.stage_tls import (
    ENV_CA,
    ENV_CERT,
    ENV_KEY,
    ENV_SERVER_NAME,
    StageTlsError,
    from_environ,
)


def _files(tmp_path: Path) -> dict[str, str]:
    env = {}
    for name, text in ((ENV_CERT, "cert"), (ENV_KEY, "key"), (ENV_CA, "ca")):
        path = tmp_path / f"{text}.pem"
        path.write_text(text)
        env[name] = str(path)
    return env


def test_none_set_means_plaintext():
    assert from_environ({}) is None
    assert from_environ({ENV_CERT: ""}) is None


def test_all_three_are_read(tmp_path):
    env = _files(tmp_path) | {ENV_SERVER_NAME: "stages.internal"}
    tls = from_environ(env)
    assert (tls.cert, tls.key, tls.ca, tls.server_name) == (
        b"cert",
        b"key",
        b"ca",
        "stages.internal",
    )
    assert from_environ(_files(tmp_path)).server_name is None


def test_some_but_not_all_is_an_error_naming_what_is_missing(tmp_path):
    env = _files(tmp_path)
    del env[ENV_KEY]
    with pytest.raises(StageTlsError, match=f"missing {ENV_KEY}"):
        from_environ(env)


def test_an_unreadable_file_is_named(tmp_path):
    env = _files(tmp_path) | {ENV_CA: str(tmp_path / "nope.pem")}
    with pytest.raises(StageTlsError, match=ENV_CA):
        from_environ(env)
