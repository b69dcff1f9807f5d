"""The checked-in generated modules are exactly what protoc makes from protos/."""

from pathlib import Path

from stagediff import _protogen


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    written = _protogen.generate(tmp_path)
    assert written, "protoc wrote nothing"
    checked_in = _protogen.REPO_ROOT / "stagediff" / "v1"
    generated_names = sorted(path.name for path in written)
    checked_in_names = sorted(path.name for path in checked_in.glob("*_pb2*.py*"))
    assert generated_names == checked_in_names, "generated files differ; run `make proto`"
    for path in written:
        expected = path.read_text()
        actual = (checked_in / path.name).read_text()
        assert actual == expected, f"stagediff/v1/{path.name} is stale; run `make proto`"
