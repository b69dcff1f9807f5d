"""The gateway's web playground (services/gateway/playground.py): its files served without a key under a strict
Content-Security-Policy, / and /playground redirecting to them, --no-playground leaving them unserved, files
that name no other origin and run no inline script or style, a label on every control, and the wheel shipping
them; and /v1/models reporting what the page needs to offer a model's controls. The page in a browser is
tests/e2e/test_demo_model_playground.py.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from services.environment_options import parse_args
from services.gateway.config import GatewayConfig
from services.gateway.options import build_parser
from services.gateway.playground import CONTENT_SECURITY_POLICY
from services.gateway.schemas import model_object
from stagediff.v1 import generation_pb2, stages_pb2
from tests.helpers.fake_orchestrator import LIMITS, MODEL
from tests.helpers.http_gateway_fake import gateway

REPOSITORY = Path(__file__).resolve().parents[2]
FILES = REPOSITORY / "services" / "gateway" / "playground"
PAGE_FILES = {
    "": "text/html",  # /playground/ is index.html
    "index.html": "text/html",
    "app.js": "text/javascript",
    "style.css": "text/css",
    "icon.svg": "image/svg+xml",
}
# An address of another origin: a scheme, or a scheme-relative //host.
ELSEWHERE = re.compile(r"""(?:[a-z][a-z0-9+.-]*:)?//[^\s"'`)]""", re.IGNORECASE)
# The one such text that fetches nothing: the SVG namespace, the name an SVG file must declare.
SVG_NAMESPACE = 'xmlns="http://www.w3.org/2000/svg"'


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, str]]:
    """The gateway in front of an orchestrator whose tenants need a key (its tenant's key)."""
    with gateway(tmp_path_factory.mktemp("state")) as served:
        yield served


@pytest.mark.parametrize(("name", "media_type"), PAGE_FILES.items())
def test_the_files_are_served_without_a_key_under_the_policy(http, name: str, media_type: str) -> None:
    client, _ = http
    answer = client.get(f"/playground/{name}")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].split(";")[0] == media_type
    assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert answer.content == (FILES / (name or "index.html")).read_bytes()


def test_the_policy_allows_the_page_nothing_from_elsewhere() -> None:
    directives = dict(directive.split(" ", 1) for directive in CONTENT_SECURITY_POLICY.split("; "))
    assert directives["default-src"] == directives["script-src"] == directives["style-src"] == "'self'"
    assert directives["img-src"] == "'self' blob: data:"
    assert directives["media-src"] == "'self' blob:"
    assert directives["connect-src"] == "'self'"
    assert directives["frame-ancestors"] == directives["object-src"] == directives["base-uri"] == "'none'"
    assert not [value for value in directives.values() if "unsafe" in value or "*" in value]


def test_the_api_still_needs_the_key(http) -> None:
    client, key = http
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert "content-security-policy" not in client.get("/healthz").headers


@pytest.mark.parametrize("path", ["/", "/playground"])
def test_the_root_and_the_bare_path_redirect_to_the_page(http, path: str) -> None:
    client, _ = http
    answer = client.get(path, follow_redirects=False)
    assert answer.status_code == 307
    # Relative, so that it holds behind a proxy's path prefix; from either path it is /playground/.
    assert answer.headers["location"] == "playground/"
    assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert client.get(path).url.path == "/playground/"


def test_an_unknown_file_is_404_under_the_policy(http) -> None:
    client, _ = http
    answer = client.get("/playground/missing.js")
    assert answer.status_code == 404
    assert answer.headers["content-security-policy"] == CONTENT_SECURITY_POLICY


def test_no_playground_leaves_its_paths_unserved(tmp_path: Path) -> None:
    """Off, the paths are as any unknown path: 401 without a key where the cluster needs one, 404 with it."""
    with gateway(tmp_path, playground=False) as (client, key):
        for path in ("/", "/playground", "/playground/", "/playground/app.js"):
            assert client.get(path, follow_redirects=False).status_code == 401, path
            answer = client.get(path, headers={"Authorization": f"Bearer {key}"}, follow_redirects=False)
            assert answer.status_code == 404, (path, answer.text)
            assert "content-security-policy" not in answer.headers


@pytest.mark.parametrize(
    ("argv", "environment", "served"),
    [([], {}, True), (["--no-playground"], {}, False), ([], {"STAGEDIFF_PLAYGROUND": "false"}, False)],
)
def test_the_flag_and_its_variable(monkeypatch, argv: list[str], environment: dict[str, str], served: bool) -> None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert GatewayConfig.from_options(parse_args(build_parser(), argv)).playground is served


def test_the_files_name_no_other_origin() -> None:
    for path in sorted(FILES.iterdir()):
        text = path.read_text().replace(SVG_NAMESPACE, "")
        assert not ELSEWHERE.findall(text), f"{path.name} names another origin"
        assert "@import" not in text and "@font-face" not in text, path.name


class _Page(HTMLParser):
    """The tags and attributes of index.html, and whether any script or style is inline."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.inline: list[str] = []
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._open = tag

    def handle_data(self, data: str) -> None:
        if self._open in ("script", "style") and data.strip():
            self.inline.append(f"<{self._open}>{data.strip()[:40]}")


def _page() -> _Page:
    page = _Page()
    page.feed((FILES / "index.html").read_text())
    return page


def test_the_page_runs_no_inline_script_or_style() -> None:
    page = _page()
    assert page.inline == []
    for tag, attrs in page.tags:
        assert "style" not in attrs, tag
        assert not [name for name in attrs if name.startswith("on")], (tag, attrs)
        if tag == "script":
            assert attrs.get("src") == "app.js", attrs
    assert [attrs["href"] for tag, attrs in page.tags if tag == "link"] == ["icon.svg", "style.css"]


def test_every_control_of_the_page_has_a_label() -> None:
    page = _page()
    labelled = {attrs.get("for") for tag, attrs in page.tags if tag == "label"}
    controls = [attrs for tag, attrs in page.tags if tag in ("input", "select", "textarea")]
    assert controls
    assert [attrs for attrs in controls if attrs.get("id") not in labelled] == []
    # Buttons are buttons, each saying what it does.
    assert all(attrs.get("type") in ("button", "submit") for tag, attrs in page.tags if tag == "button")
    assert ("html", {"lang": "en"}) in page.tags


def test_the_wheel_ships_every_file_of_the_page() -> None:
    setuptools = tomllib.loads((REPOSITORY / "server" / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setuptools["package-data"]["services.gateway"]
    package = REPOSITORY / "services" / "gateway"
    shipped = {path for pattern in patterns for path in package.glob(pattern)}
    assert shipped == set(FILES.iterdir())


def test_models_report_what_the_page_offers(http) -> None:
    client, key = http
    (listed,) = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    assert listed["id"] == MODEL and listed["output"] == "video"
    limits = listed["limits"]
    assert (limits["width_multiple"], limits["max_width"], limits["max_height"]) == (16, 1024, 1024)
    assert (limits["temporal_factor"], limits["max_frames"]) == (LIMITS.temporal_factor, LIMITS.max_frames)
    assert limits["default_num_inference_steps"] == LIMITS.default_inference_steps
    assert limits["default_cache"] == {"method": "none", "threshold": None}


def test_a_one_frame_model_makes_images_and_its_caches_are_listed() -> None:
    limits = stages_pb2.ModelLimits(
        max_frames=1,
        height_multiple=16,
        cache_methods=[stages_pb2.StepCache(method="teacache", threshold=0.2)],
        default_cache=stages_pb2.StepCache(method="teacache"),
        image_roles=["reference", "reference"],
        required_image_roles=["reference"],
        max_loras=2,
    )
    model = model_object(generation_pb2.ModelDescription(id="edit", limits=limits))
    assert model["output"] == "image"
    assert model["limits"]["min_height"] == 16  # no min_height of its own: one multiple
    assert model["limits"]["cache_methods"] == [{"method": "teacache", "threshold": pytest.approx(0.2)}]
    assert model["limits"]["default_cache"] == {"method": "teacache", "threshold": None}
    assert model["limits"]["required_image_roles"] == ["reference"] and model["limits"]["max_loras"] == 2
