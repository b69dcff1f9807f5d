"""`stagediff serve` options from the command line, STAGEDIFF_* variables and a --config file
(services/environment_options.py), in that precedence."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.environment_options import OptionParser, environment_variable, parse_args


def _parser() -> OptionParser:
    parser = OptionParser(prog="stagediff serve dit")
    parser.add_argument("--model", required=True)
    parser.add_argument("--ulysses-degree", "--usp", type=int, default=1)
    parser.add_argument("--quantization", choices=["fp8", "int8"])
    parser.add_argument("--ignored-layers", nargs="+", default=[])
    parser.add_argument("--use-hsdp", action="store_true")
    return parser


def test_variable_names_follow_the_long_option() -> None:
    assert environment_variable("--ulysses-degree") == "STAGEDIFF_ULYSSES_DEGREE"
    assert environment_variable("--vae-patch-parallel-size") == "STAGEDIFF_VAE_PATCH_PARALLEL_SIZE"


def test_every_kind_of_option_is_read_and_the_command_line_wins() -> None:
    environ = {
        "STAGEDIFF_MODEL": "/models/model",
        "STAGEDIFF_ULYSSES_DEGREE": "4",
        "STAGEDIFF_QUANTIZATION": "fp8",
        "STAGEDIFF_IGNORED_LAYERS": "[proj_out, blocks.0.*]",
        "STAGEDIFF_USE_HSDP": "true",
    }
    args = parse_args(_parser(), [], environ)
    assert (args.model, args.ulysses_degree, args.quantization) == ("/models/model", 4, "fp8")
    assert args.ignored_layers == ["proj_out", "blocks.0.*"] and args.use_hsdp is True
    overridden = parse_args(_parser(), ["--usp", "2", "--model", "/other"], environ)
    assert (overridden.ulysses_degree, overridden.model) == (2, "/other")
    assert parse_args(_parser(), ["--model", "m"], {"STAGEDIFF_USE_HSDP": "off"}).use_hsdp is False


def test_the_command_line_wins_over_the_environment_which_wins_over_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "dit.yaml"
    config.write_text("model: /from/config\nulysses-degree: 2\nquantization: int8\nuse-hsdp: true\n")
    with_config = ["--config", str(config)]
    args = parse_args(_parser(), with_config, {})
    assert (args.model, args.ulysses_degree, args.quantization, args.use_hsdp) == ("/from/config", 2, "int8", True)
    environ = {"STAGEDIFF_ULYSSES_DEGREE": "4", "STAGEDIFF_USE_HSDP": "false"}
    args = parse_args(_parser(), with_config, environ)
    assert (args.ulysses_degree, args.quantization, args.use_hsdp) == (4, "int8", False)
    args = parse_args(_parser(), [*with_config, "--usp", "8"], environ)
    assert args.ulysses_degree == 8
    assert parse_args(_parser(), ["--model", "m"], {}).ulysses_degree == 1, "the default, without any source"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        (
            "STAGEDIFF_ULYSSES_DEGREE",
            "four",
            "STAGEDIFF_ULYSSES_DEGREE='four': argument --ulysses-degree/--usp: invalid int",
        ),
        ("STAGEDIFF_QUANTIZATION", "fp4", "STAGEDIFF_QUANTIZATION='fp4': argument --quantization: invalid choice"),
        ("STAGEDIFF_USE_HSDP", "maybe", "STAGEDIFF_USE_HSDP: 'maybe'. Expecting 'true', 'false'"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(
    variable: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(_parser(), ["--model", "m"], {variable: value})
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bad_config_file_is_refused_naming_the_file_and_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "dit.yaml"
    for text, message in (
        ("ulysses-degree: four\n", f"{config}: ulysses-degree='four': argument --ulysses-degree/--usp: invalid int"),
        # Names are exact: a misspelt key is no abbreviation of an option.
        ("ulysses-degre: 2\n", "unrecognized arguments: --ulysses-degre=2"),
    ):
        config.write_text(text)
        with pytest.raises(SystemExit):
            parse_args(_parser(), ["--model", "m", "--config", str(config)], {})
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(_parser(), ["--model", "m", "--config", str(tmp_path / "missing.yaml")], {})
    assert "missing.yaml" in capsys.readouterr().err


def test_variables_naming_no_option_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    environ = {
        "STAGEDIFF_ULYSES_DEGREE": "4",
        "STAGEDIFF_CONFIG": "/etc/stagediff.yaml",  # --config is read from the command line only
        "STAGEDIFF_CLUSTER_SECRET": "s",
        "OTHER": "x",
    }
    with caplog.at_level(logging.WARNING):
        args = parse_args(_parser(), ["--model", "m"], environ)
    assert args.ulysses_degree == 1
    assert "STAGEDIFF_ULYSES_DEGREE" in caplog.text and "STAGEDIFF_CONFIG" in caplog.text
    assert "STAGEDIFF_CLUSTER_SECRET" not in caplog.text
