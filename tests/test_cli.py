"""The CLI and config loading refuse bad input with one clear message, before
anything runs."""

from typing import get_args

import pytest
from click.testing import CliRunner

from tracefp4.pipelines.cli import main
from tracefp4.schemas import ConfigError, Method, load_config


@pytest.mark.parametrize(
    "methods, message",
    [("trace,nope", "unknown method(s) nope"), ("trace,qat,trace", "method(s) trace named more than once")],
)
def test_compare_rejects_unknown_and_repeated_methods(tmp_path, methods, message):
    args = ["run", "--preset", "smoke", "--output", str(tmp_path / "run"), "--compare", methods]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and message in result.output and "--compare" in result.output
    if "nope" in methods:
        assert all(m in result.output for m in get_args(Method))  # the valid choices are named
    assert not (tmp_path / "run").exists()  # refused before anything ran


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.yaml.*\n.*not UTF-8 text: byte 0xe9 at offset 9"):
        load_config(path)
    result = CliRunner().invoke(main, ["compile", "--config", str(path), "--output", str(tmp_path / "p.yaml")])
    assert result.exit_code == 1 and "not UTF-8" in result.output and "Traceback" not in result.output


def test_an_unknown_preset_is_a_config_error():
    with pytest.raises(ConfigError, match=r"preset: unknown run preset 'nope'; expected one of \[.*'smoke'"):
        load_config(preset="nope")
