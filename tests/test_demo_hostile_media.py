"""Hostile images (issue 28, items 1-3) on the tiny LLaVA of test_demo_images: a URL that does not
parse is a 400 naming the part; a remote host that drips its headers (or a name lookup that hangs)
is cut at --media-fetch-timeout; an image whose processed size would be huge (1 x 120,000 pixels
in 553 bytes: the processor scales its short side up) is refused from its header, before any
pixel is decoded; decoding and processing run in a bounded number of requests at once."""

from __future__ import annotations

import io
import socket
import threading
import time

import pytest
from PIL import Image

from demo.api import images
from demo.api.app import create_app
from demo.model import vision
from tests.demo_checkpoints import data_url, png
from tests.test_demo_images import _refused, checkpoint, engine, make_config, post, text, user  # noqa: F401


def test_malformed_image_urls_are_400s_naming_the_part(engine, checkpoint):  # noqa: F811
    """Default flags (no remote host allowed) and a host allowed: the URL is parsed under the
    error handling either way."""
    for allowed in ((), ("h",)):
        client = create_app(make_config(checkpoint, allowed_media_domains=allowed), engine).test_client()
        for url in ("http://[::1/x.png", "http://[zz]/x.png", "http://a\uff03b@h/", "http://h:99999/x.png"):
            r = post(client, [user("look", url)], status=400)
            _refused(r, "messages[0].content[1]", "malformed")


class _Drip:
    """A loopback HTTP server that sends a status line, then one header byte every 0.3 s for
    ``seconds``: every read returns within a socket timeout, the whole never ends."""

    def __init__(self, seconds: float = 20.0):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.seconds, self.served = self.sock.getsockname()[1], seconds, threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        self.served.set()
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                end = time.monotonic() + self.seconds
                while time.monotonic() < end:
                    conn.sendall(b"X")
                    time.sleep(0.3)
            except OSError:  # the client cut the connection: what the fix does
                pass

    def close(self) -> None:
        self.sock.close()


def test_a_header_drip_is_cut_at_the_fetch_timeout(engine, checkpoint):  # noqa: F811
    drip = _Drip(seconds=20.0)
    try:
        cfg = make_config(checkpoint, allowed_media_domains=("127.0.0.1",), media_fetch_timeout=1.0)
        client = create_app(cfg, engine).test_client()
        started = time.monotonic()
        r = post(client, [user(f"http://127.0.0.1:{drip.port}/x.png", "what?")], status=400)
        took = time.monotonic() - started
    finally:
        drip.close()
    assert drip.served.is_set()
    _refused(r, "messages[0].content[0]", "longer than 1.0 s")
    assert took < 10, took  # the drip lasts 20 s; one deadline ends it after ~1 s


def test_a_hanging_name_lookup_is_inside_the_same_deadline(engine, checkpoint, monkeypatch):  # noqa: F811
    def hangs(*args, **kwargs):
        time.sleep(20)
        raise socket.gaierror(socket.EAI_AGAIN, "temporary failure")

    monkeypatch.setattr(socket, "getaddrinfo", hangs)
    cfg = make_config(checkpoint, allowed_media_domains=("slow.example",), media_fetch_timeout=1.0)
    client = create_app(cfg, engine).test_client()
    started = time.monotonic()
    r = post(client, [user("http://slow.example/x.png")], status=400)
    assert time.monotonic() - started < 10
    _refused(r, "messages[0].content[0]", "longer than 1.0 s")


def _canvas(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("1", (width, height)).save(out, format="PNG")
    return out.getvalue()


def test_an_extreme_aspect_ratio_is_refused_before_the_processor_allocates(engine, checkpoint, monkeypatch):  # noqa: F811
    """1 x 120,000 pixels in a few hundred bytes (0.3% of the pixel cap): the processor would
    scale the short side to 32 and build 32 x 3.84M pixels. Refused from the header: neither
    the pixels nor the processor are touched."""
    client = create_app(make_config(checkpoint), engine).test_client()
    raw = _canvas(1, 120_000)
    assert len(raw) < 2000
    calls = []
    monkeypatch.setattr(vision, "render", lambda *a, **k: calls.append(a) or pytest.fail("processor ran"))
    monkeypatch.setattr(images, "_rgb", lambda image: pytest.fail("pixels decoded"))
    r = post(client, [user(data_url(raw), "what?")], status=400)
    _refused(r, "messages[0].content[0]", "aspect ratio")
    assert calls == []


def test_the_processed_pixel_bound_uses_the_processors_resize(engine, checkpoint):  # noqa: F811
    """The estimate is an upper bound, within a few percent, of what the processor makes (its
    resize, crop off), and a bound below it refuses the image naming the processor's count."""
    processor = engine.processor
    for width, height in ((10, 1000), (64, 32), (5, 5), (300, 40)):
        before = processor.image_processor.do_center_crop
        processor.image_processor.do_center_crop = False
        try:
            shape = processor.image_processor(Image.new("RGB", (width, height)), return_tensors="np")[
                "pixel_values"
            ].shape
        finally:
            processor.image_processor.do_center_crop = before
        made = shape[-1] * shape[-2]
        estimate = vision.processed_pixels(processor, width, height)
        assert made <= estimate <= 1.1 * made + 100, (width, height, made, estimate)
    # Qwen2-VL's processor names pixel counts, not edges, in its size (min 3,136, max 1,003,520)
    from transformers import Qwen2VLImageProcessor

    class Qwen:
        image_processor = Qwen2VLImageProcessor()

    for width, height in ((2000, 1000), (30, 30), (3000, 3000), (100, 5000)):
        grid = Qwen.image_processor(Image.new("RGB", (width, height)), return_tensors="np")["image_grid_thw"][
            0
        ]
        made = int(grid[1] * grid[2] * 14 * 14)
        estimate = vision.processed_pixels(Qwen, width, height)
        assert made <= estimate <= 2 * made + 10_000 < images.MAX_PROCESSED_PIXELS, (
            width,
            height,
            made,
            estimate,
        )
    policy = images.MediaPolicy(max_processed_pixels=50_000)
    part = images.ImagePart("data:", "messages[0].content[0]")
    with pytest.raises(images.ApiError, match="would make 105633 pixels"):
        images.check_size(10, 1000, part, policy, lambda w, h: vision.processed_pixels(processor, w, h))
    images.check_size(64, 32, part, policy, lambda w, h: vision.processed_pixels(processor, w, h))


def test_images_are_processed_by_a_bounded_number_of_requests_at_once(engine, checkpoint, monkeypatch):  # noqa: F811
    """Six requests with images at once: decoding and the processor run in at most
    ``processing_slots`` (2) of them at a time; every request is still answered."""
    client = create_app(make_config(checkpoint), engine).test_client()
    lock, now, most = threading.Lock(), [0], [0]
    real_render = vision.render

    def slow_render(processor, messages, pictures, *videos):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            time.sleep(0.3)
            return real_render(processor, messages, pictures, *videos)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(vision, "render", slow_render)
    replies = []

    def ask(i: int) -> None:
        replies.append(post(client, [user(data_url(png(20 + i)), f"image {i}?")], max_tokens=1))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(replies) == 6 and all(text(r) is not None for r in replies)
    assert 1 <= most[0] <= 2, most[0]
