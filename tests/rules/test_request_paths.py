"""Paths a request names, checked without opening anything: `..`, escapes, names the filesystem cannot hold and any
OSError are a `RequestError` naming the field (issue 54: a 300-byte component answered HTTP 500)."""

from __future__ import annotations

import pytest

from h3serve.rules.request_paths import is_file, name_limits, path_under
from h3serve.rules.validate import RequestError

WHERE = "the test directory (--test-dir)"


def test_a_file_inside_the_root_resolves(tmp_path):
    (tmp_path / "a.mp4").write_bytes(b"x")
    assert path_under("a.mp4", tmp_path, "f", WHERE) == (tmp_path / "a.mp4").resolve()
    assert is_file(path_under("a.mp4", tmp_path, "f", WHERE), "f")


@pytest.mark.parametrize("text, says", [
    ("a" * 300, "a path component is 300 bytes"),
    ("d/" + "é" * 150, "a path component is 300 bytes"),
    ("x/" * 2100, "the path is 4,200 bytes"),
    ("../secret", "must not contain '..'"),
    ("/etc/passwd", "is outside the test directory"),
    ("a\x00b", "cannot be resolved"),
])
def test_a_path_the_rules_refuse_names_the_field(tmp_path, text, says):
    with pytest.raises(RequestError, match=says) as refused:
        path_under(text, tmp_path, "extra_params.canny.control_path", WHERE)
    assert refused.value.field == "extra_params.canny.control_path"


def test_an_oserror_while_checking_is_a_request_error(tmp_path):
    assert name_limits(tmp_path)[0] >= 255
    with pytest.raises(RequestError) as refused:
        is_file(tmp_path / ("b" * 300), "lora.path")  # ENAMETOOLONG from stat: Path.is_file raises it
    assert refused.value.field == "lora.path" and str(tmp_path) not in str(refused.value)
