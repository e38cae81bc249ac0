"""/docs and /redoc work with no network: every script, style sheet and icon they reference is served
by the gateway itself (training clusters seldom reach a CDN)."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import httpx
import pytest

from codeenv.api import create_app
from codeenv.queue import embedded
from codeenv.settings import GatewaySettings

pytestmark = pytest.mark.unit


class References(HTMLParser):
    """Every URL a page makes the browser load: src= and href= of any tag, url(...) in inline styles."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]


def page_urls(html: str) -> list[str]:
    parser = References()
    parser.feed(html)
    # Inline scripts name URLs too (Swagger UI's `url: '/openapi.json'`): any quoted URL or path.
    quoted = re.findall(r"""['"`]((?:https?:)?//[^'"`\s]+|/[A-Za-z0-9_./-]+)['"`]""", html)
    return parser.urls + quoted


def app(token: str | None = None) -> httpx.AsyncClient:
    settings = GatewaySettings(token=token)
    gateway = create_app(settings, embedded.from_settings(settings))  # no lifespan: no pool starts
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway), base_url="http://127.0.0.1:8000")


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_docs_pages_load_everything_from_the_gateway(page: str) -> None:
    async with app() as client:
        response = await client.get(page)
        assert response.status_code == 200, response.text
        urls = page_urls(response.text)
        external = [u for u in urls if re.match(r"(https?:)?//", u)]
        assert not external, f"{page} references URLs outside the gateway: {external}"
        if page == "/docs":
            assert '"validatorUrl": null' in response.text  # else Swagger UI asks validator.swagger.io
        assets = [u for u in urls if u.startswith("/docs/assets/")]
        assert any(u.endswith(".js") for u in assets), urls
        for url in set(urls):
            got = await client.get(url)
            assert got.status_code == 200, f"{page} references {url}, answered {got.status_code}"
            assert got.content, url


async def test_docs_need_the_token_like_every_path() -> None:
    """With a token a browser gets 401 on /docs (the README says how to read the document then)."""
    token = "t" * 32
    async with app(token) as client:
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui.css"):
            refused = await client.get(path)  # what the browser shows: how to read the document instead
            assert refused.status_code == 401 and "curl -H 'Authorization: Bearer <token>'" in refused.text, path
        assert "/openapi.json" not in (await client.get("/v1/results/x")).text  # other paths: the plain answer
        headers = {"Authorization": f"Bearer {token}"}
        assert (await client.get("/docs", headers=headers)).status_code == 200
        assert (await client.get("/openapi.json", headers=headers)).status_code == 200
