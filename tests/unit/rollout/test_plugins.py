"""plugins.load_function: each way a dotted path can be wrong gives an error naming the flag."""

from __future__ import annotations

import sys
import textwrap

import pytest

from miles_platform.config import ConfigError
from miles_platform.plugins import load_function


@pytest.fixture
def mod(tmp_path, monkeypatch):
    (tmp_path / "plug_ok.py").write_text(
        textwrap.dedent(
            """
            NOT_CALLABLE = 3

            def two(a, b):
                return a + b

            def two_plus_default(a, b, c=1, **kw):
                return a + b + c

            def star(*args):
                return len(args)
            """
        )
    )
    (tmp_path / "plug_broken.py").write_text("import does_not_exist_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("plug_ok", "plug_broken"):
        sys.modules.pop(name, None)


def test_loads_and_checks_arity(mod):
    assert load_function("plug_ok.two", "--x", required_params=2)(1, 2) == 3
    assert load_function("plug_ok.two_plus_default", "--x", required_params=2)(1, 2) == 4
    assert load_function("plug_ok.star", "--x", required_params=4)(1, 2, 3, 4) == 4
    assert load_function("os.path.join", "--x")("a", "b") == "a/b"


@pytest.mark.parametrize(
    "path, required, message",
    [
        ("nodots", None, r"--custom-rm-path 'nodots': expected a dotted path"),
        (
            "no_such_module_q.fn",
            None,
            r"--custom-rm-path .*cannot import module 'no_such_module_q'.*ModuleNotFound",
        ),
        ("plug_broken.fn", None, r"cannot import module 'plug_broken'.*does_not_exist_xyz"),
        ("plug_ok.missing", None, r"has no attribute 'missing'.*'two'"),
        ("plug_ok.NOT_CALLABLE", None, r"'NOT_CALLABLE' is a int, not a function"),
        ("plug_ok.two", 3, r"must take 3 positional argument\(s\), it takes 2"),
        ("plug_ok.two", 1, r"must take 1 positional argument\(s\), it takes 2 \(2 required\)"),
    ],
)
def test_errors_name_the_flag(mod, path, required, message):
    with pytest.raises(ConfigError, match=message):
        load_function(path, "--custom-rm-path", required_params=required)
