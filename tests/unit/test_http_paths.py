"""services/gateway/http/app.py path_segments: split, then percent-decode each segment."""

from __future__ import annotations

import pytest

from services.gateway.http.app import path_segments


@pytest.mark.parametrize(
    ("raw", "segments"),
    [
        (b"/v2/models/simple/ready", ["v2", "models", "simple", "ready"]),
        (b"/v2/models/a%2Fb/ready", ["v2", "models", "a/b", "ready"]),
        (b"/v2/repository/models/%2Fetc/load", ["v2", "repository", "models", "/etc", "load"]),
        (b"/v2/models/%2E%2E", ["v2", "models", ".."]),
        (b"/v2/models/a%00b", ["v2", "models", "a\x00b"]),
        (b"/v2/models/a%20b/", ["v2", "models", "a b"]),  # a trailing slash is tolerated
        (b"/v2/models/%ZZ", ["v2", "models", "%ZZ"]),  # not an escape: kept
        (b"/v2/models/%C3%A9%FF", ["v2", "models", "\u00e9\ufffd"]),
        (b"/v2/models//ready", [""]),  # an empty segment matches no route
        (b"/", []),
    ],
)
def test_segments_are_decoded_one_by_one(raw: bytes, segments: list[str]) -> None:
    assert path_segments(raw, "ignored") == segments


def test_without_raw_path_the_decoded_path_is_split() -> None:
    assert path_segments(None, "/v2/health/live") == ["v2", "health", "live"]
