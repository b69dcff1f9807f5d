"""Regenerates the checked-in gRPC modules under stagediff/v1 from protos/.

Run `python -m stagediff._protogen` after editing a .proto file; a test fails if
the checked-in modules differ from what this produces.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "stagediff" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Runs grpc_tools.protoc into out_dir and returns the written files."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed; see the messages above")
    written = sorted((out_dir / "stagediff" / "v1").glob("*_pb2*.py*"))
    for path in written:
        # Keep generated files free of the absolute paths of whoever ran protoc.
        text = path.read_text()
        path.write_text(re.sub(r"[ \t]+\n", "\n", text))
    return written


def main() -> int:
    generate(REPO_ROOT)
    init = REPO_ROOT / "stagediff" / "v1" / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf and gRPC modules for stagediff.v1 (do not edit)."""\n')
    return 0


if __name__ == "__main__":
    sys.exit(main())
