"""A Python environment without the server packages: the client-only install, as the plain `pip install .`
leaves it (packages listed here are made unimportable by a meta path finder written into the environment)."""

from __future__ import annotations

import os
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]


# Top-level packages only the servers need: third-party ones of the `server` extra and the first-party server code.
# (grpc_reflection is not among them: grpc itself imports it where it is installed.)
SERVER_PACKAGES = (
    "torch",
    "torchao",
    "diffusers",
    "transformers",
    "tokenizers",
    "safetensors",
    "accelerate",
    "cv2",
    "ftfy",
    "yaml",
    "pydantic",
    "prometheus_client",
    "services",
    "families",
    "stagekit",
    "text_encoder_svc",
    "dit_svc",
    "vae_svc",
    "interp_svc",
    "tools",
)


# stagediff's own package that runs a server command (`stagediff up`): the client never loads it, and the client's
# distribution does not hold it.
SERVER_COMMAND_MODULES = ("stagediff.local",)
NOT_INSTALLED_FINDER = '''"""Makes the listed packages unimportable, as in an environment that does not have them."""
import sys

NOT_INSTALLED = frozenset({names!r})


class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if any(name == missing or name.startswith(missing + ".") for missing in NOT_INSTALLED):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, NotInstalled())
'''


def client_only_environment(directory: Path) -> dict[str, str]:
    """The environment of a Python process that can import neither the server packages nor opentelemetry (which
    the plain install does not bring): a `sitecustomize` module, found first on PYTHONPATH, refuses them."""
    directory.mkdir(parents=True, exist_ok=True)
    not_installed = sorted({*SERVER_PACKAGES, *SERVER_COMMAND_MODULES, "opentelemetry"})
    (directory / "sitecustomize.py").write_text(NOT_INSTALLED_FINDER.format(names=not_installed))
    path = [str(directory), str(REPOSITORY), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
