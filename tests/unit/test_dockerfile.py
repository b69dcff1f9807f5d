"""deploy/Dockerfile, read without a Docker engine: layer order, the dependency list it installs, the user."""

from __future__ import annotations

import shlex
import tomllib

from tests.helpers.dockerfile import REPOSITORY, instructions

# The two projects the image installs: the client (the root) and the servers.
PROJECTS = (REPOSITORY / "pyproject.toml", REPOSITORY / "server" / "pyproject.toml")


def test_dependencies_are_installed_before_the_source_is_copied() -> None:
    """A code change must not invalidate the layer holding torch and the dependencies."""
    steps = instructions()
    copies = [index for index, (name, _) in enumerate(steps) if name == "COPY"]
    dependency_install = next(i for i, (name, args) in enumerate(steps) if name == "RUN" and "requirements" in args)
    before = [steps[index][1] for index in copies if index < dependency_install]
    assert before == ["pyproject.toml ./", "server/pyproject.toml ./server/"], "only the pyproject files come first"
    torch_install = next(i for i, (name, args) in enumerate(steps) if name == "RUN" and "torch==" in args)
    assert torch_install < dependency_install, "torch first and pinned, so no dependency pulls another build"
    project_install = [args for name, args in steps if name == "RUN" and "pip install --no-deps . ./server" in args]
    assert project_install, "the client and the servers install without touching the dependency layer"


def test_the_image_copies_every_package_the_two_projects_build() -> None:
    """`pip install . ./server` builds from what was copied: a package folder left out fails the build."""
    copied = {args.split()[0].partition("/")[0] for name, args in instructions() if name == "COPY"}  # top folders
    for project in PROJECTS:
        setuptools = tomllib.loads(project.read_text())["tool"]["setuptools"]
        mapped = {package: folder.removeprefix("../") for package, folder in setuptools.get("package-dir", {}).items()}
        for package in setuptools["packages"]:
            folder = mapped.get(package, package.replace(".", "/"))
            assert folder.partition("/")[0] in copied, f"{package} ({folder}) is not copied"


def test_the_image_runs_as_a_non_root_user_with_stagediff_as_entrypoint() -> None:
    steps = instructions()
    users = [args for name, args in steps if name == "USER"]
    assert users and users[-1] not in ("root", "0")
    assert ("ENTRYPOINT", '["stagediff"]') in steps
    for port in (50051, 50061, 50062, 50063, 50064):
        assert str(port) in next(args for name, args in steps if name == "EXPOSE")


def test_secrets_and_local_artifacts_stay_out_of_the_build_context() -> None:
    ignored = (REPOSITORY / ".dockerignore").read_text().split()
    for path in ("deploy/secrets/", "deploy/k8s/secrets/", "models/", ".venv/", ".git/"):
        assert path in ignored, path


def test_the_state_directory_belongs_to_the_image_user() -> None:
    """A fresh named volume on /var/lib/stagediff takes the image directory's owner: it must be the user that
    runs the orchestrator, or its job store cannot be written."""
    steps = instructions()
    last_user = max(index for index, (name, _) in enumerate(steps) if name == "USER")
    user = steps[last_user][1]
    commands = [
        shlex.split(command) for name, args in steps[:last_user] if name == "RUN" for command in args.split("&&")
    ]
    uid = next(command[command.index("--uid") + 1] for command in commands if command[0] == "useradd")
    assert uid == "1000", "the Kubernetes manifests run as uid 1000"
    created = [command for command in commands if command[:2] == ["mkdir", "-p"] and "/var/lib/stagediff" in command]
    owners = [command[1] for command in commands if command[0] == "chown" and command[-1] == "/var/lib/stagediff"]
    assert created, "no RUN before USER creates /var/lib/stagediff"
    assert owners and owners[-1].partition(":")[0] in (user, uid), f"/var/lib/stagediff must belong to {user}"
    compose = (REPOSITORY / "deploy" / "common-services.yml").read_text()
    assert '"--state-dir", "/var/lib/stagediff"' in compose and "stagediff-state:/var/lib/stagediff" in compose
