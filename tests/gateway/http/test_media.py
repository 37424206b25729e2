"""Media URLs under media_urls = "deny_private" (gateway.http.media)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import BadRequest
from gateway.http.media import check, media_urls


def payload(*urls: str, kind: str = "image_url") -> dict[str, object]:
    return {"messages": [
        {"role": "system", "content": "plain text"},
        {"role": "user", "content": [{"type": "text", "text": "look"}, *(
            {"type": kind, kind: {"url": url}} for url in urls)]}]}


def refused(body: dict[str, object]) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        asyncio.run(check(body))
    return caught.value


def test_every_media_field_is_found_with_its_path() -> None:
    body = payload("http://a/1.png", "http://b/2.png")
    body["messages"].append({"role": "user", "content": [  # type: ignore[attr-defined]
        {"type": "audio_url", "audio_url": {"url": "http://c/3.wav"}},
        {"type": "video_url", "video_url": "http://d/4.mp4"}]})
    assert list(media_urls(body)) == [
        ("messages.1.content.1.image_url.url", "http://a/1.png"),
        ("messages.1.content.2.image_url.url", "http://b/2.png"),
        ("messages.2.content.0.audio_url.url", "http://c/3.wav"),
        ("messages.2.content.1.video_url.url", "http://d/4.mp4")]


@pytest.mark.parametrize("url", [
    "http://127.0.0.1/x.png", "http://10.1.2.3/x.png", "http://192.168.0.1/x.png",
    "http://169.254.169.254/latest/meta-data/", "http://[::1]/x.png",
    "http://[::ffff:127.0.0.1]/x.png", "http://0.0.0.0/x.png", "http://localhost:8000/x.png",
    "http://[fd00:ec2::254]/x.png", "http://224.0.0.1/x.png"])
def test_private_loopback_link_local_and_reserved_addresses_are_refused(url: str) -> None:
    error = refused(payload("http://93.184.216.34/ok.png", url))
    assert error.status == 400 and error.param == "messages.1.content.2.image_url.url"
    assert "address" in error.message


@pytest.mark.parametrize("url", ["file:///etc/passwd", "gopher://x/", "ftp://1.1.1.1/a",
                                 "http:///nohost"])
def test_schemes_other_than_http_and_data_are_refused(url: str) -> None:
    assert refused(payload(url, kind="audio_url")).param == "messages.1.content.1.audio_url.url"


def test_public_addresses_and_inline_data_pass() -> None:
    asyncio.run(check(payload("https://93.184.216.34/x.png", "data:image/png;base64,iVBORw0K",
                              "http://[2606:4700::1111]/y.png")))
    asyncio.run(check({"messages": "not a list"}))
