"""Images in chat requests: OpenAI ``image_url`` content parts to PIL images, under the operator's limits.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR..."}}

- ``data:`` URLs (base64) are decoded here, nothing is fetched;
- ``http(s)`` URLs are refused unless their host is in ``--allowed-media-domains`` (vLLM's flag;
  a server that fetches any URL for anonymous callers reaches its own network: SSRF). Allowed
  ones are fetched within ``--media-fetch-timeout`` seconds (the whole download) and
  ``--max-image-bytes``, without following redirects (a redirect may point anywhere);
- any other scheme (``file:``, ``ftp:``) is refused;
- at most ``--limit-mm-per-prompt`` images per request (vLLM's flag: ``image=4`` or
  ``{"image": 4}``), each at most ``--max-image-bytes`` of encoded bytes and ``MAX_PIXELS`` pixels
  (a small PNG can claim a huge canvas), decoded by Pillow as PNG, JPEG, GIF, WebP or BMP.

Each refusal is a 400 whose ``param`` names the part (``messages[0].content[1]``).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from demo.errors import ApiError

MAX_PIXELS = 40_000_000  # per image, width x height (Pillow's own bomb guard is ~179 M)
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
_CHUNK = 64 << 10


@dataclass(frozen=True)
class ImagePart:
    """An ``image_url`` content part: its URL and where it sat (for error messages)."""

    url: str
    param: str  # e.g. "messages[0].content[1]"


@dataclass(frozen=True)
class MediaPolicy:
    max_images: int = 4  # per request (vLLM: --limit-mm-per-prompt)
    max_image_bytes: int = 8 << 20  # encoded bytes of one image (decoded data: URL or download)
    allowed_domains: tuple[str, ...] = ()  # hosts http(s) images may come from; () = none
    fetch_timeout: float = 5.0  # seconds for one whole download
    max_pixels: int = MAX_PIXELS

    def __post_init__(self) -> None:
        if self.max_images < 0 or self.max_image_bytes < 1 or self.fetch_timeout <= 0 or self.max_pixels < 1:
            raise ValueError(
                "limit-mm-per-prompt must be >= 0, max-image-bytes >= 1 and media-fetch-timeout > 0, got "
                f"{self.max_images}, {self.max_image_bytes}, {self.fetch_timeout}"
            )

    @property
    def body_bytes(self) -> int:
        """A request body limit that fits ``max_images`` images as base64 data: URLs plus text."""
        return (1 << 20) + self.max_images * (4 * -(-self.max_image_bytes // 3) + 1024)


def parse_limit_mm(text: str) -> int:
    """Images per request from ``image=N`` or ``{"image": N}`` (vLLM's forms); ValueError else."""
    text = text.strip()
    try:
        limits = json.loads(text) if text.startswith("{") else dict([text.split("=", 1)])
    except ValueError:
        limits = None
    if not isinstance(limits, dict) or set(limits) != {"image"}:
        raise ValueError(f'--limit-mm-per-prompt takes image=N or {{"image": N}}, got {text!r}')
    try:
        value = int(limits["image"])
    except (TypeError, ValueError):
        raise ValueError(f"--limit-mm-per-prompt: the image limit must be an integer, got {text!r}") from None
    if value < 0:
        raise ValueError(f"--limit-mm-per-prompt: the image limit must be >= 0, got {value}")
    return value


def image_parts(messages: list[dict]) -> list[ImagePart]:
    """The image parts of checked chat messages (demo.api.schema), in prompt order."""
    return [
        ImagePart(part["url"], part["param"])
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] == "image_url"
    ]


def _bad(part: ImagePart, message: str) -> ApiError:
    return ApiError(400, f"{part.param}: {message}", part.param, "invalid_image")


def load_images(parts: list[ImagePart], policy: MediaPolicy) -> list:
    """One PIL image (RGB) per part, in order; ApiError 400 naming the first part refused."""
    if len(parts) > policy.max_images:
        raise _bad(
            parts[policy.max_images],
            f"at most {policy.max_images} images per request (--limit-mm-per-prompt), got {len(parts)}",
        )
    return [decode(fetch_bytes(part, policy), part, policy) for part in parts]


def fetch_bytes(part: ImagePart, policy: MediaPolicy) -> bytes:
    """The image's encoded bytes, from a data: URL or an allowed http(s) host."""
    url = part.url
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(part, policy)
    if scheme not in ("http", "https"):
        raise _bad(part, "the image URL must be a data: URL (base64) or http(s)")
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in policy.allowed_domains:
        raise _bad(
            part,
            f"fetching images from {host or 'that URL'!r} is not allowed on this server: send the image "
            "as a data: URL (operators allow hosts with --allowed-media-domains)",
        )
    return _download(part, policy)


def _data_url(part: ImagePart, policy: MediaPolicy) -> bytes:
    head, comma, data = part.url.partition(",")
    if not comma or not head.lower().endswith(";base64"):
        raise _bad(part, "a data: URL must look like data:image/png;base64,<data>")
    if len(data) > 4 * -(-policy.max_image_bytes // 3) + 4:
        raise _bad(part, f"the image is larger than {policy.max_image_bytes} bytes (--max-image-bytes)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(part, "the data: URL is not valid base64") from None
    if len(raw) > policy.max_image_bytes:
        raise _bad(part, f"the image is larger than {policy.max_image_bytes} bytes (--max-image-bytes)")
    return raw


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl} not followed", headers, fp)


def _download(part: ImagePart, policy: MediaPolicy) -> bytes:
    """GET ``part.url`` within the policy's time and size limits (no proxies, no redirects)."""
    deadline = time.monotonic() + policy.fetch_timeout
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects)
    req = urllib.request.Request(part.url, headers={"User-Agent": "radixkv-demo"})
    try:
        with opener.open(req, timeout=policy.fetch_timeout) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > policy.max_image_bytes:
                raise _bad(
                    part, f"the image is larger than {policy.max_image_bytes} bytes (--max-image-bytes)"
                )
            chunks, size = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunk = resp.read1(_CHUNK)  # what has arrived: the deadline is checked between reads
                if not chunk:
                    break
                size += len(chunk)
                if size > policy.max_image_bytes:
                    raise _bad(
                        part, f"the image is larger than {policy.max_image_bytes} bytes (--max-image-bytes)"
                    )
                chunks.append(chunk)
    except TimeoutError:
        raise _bad(part, f"fetching the image took longer than {policy.fetch_timeout} s") from None
    except urllib.error.HTTPError as e:
        raise _bad(part, f"fetching the image failed: HTTP {e.code} {e.msg}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            raise _bad(part, f"fetching the image took longer than {policy.fetch_timeout} s") from None
        raise _bad(part, f"fetching the image failed: {reason}") from None
    except (http.client.HTTPException, ValueError, OverflowError) as e:
        # A URL urllib cannot open (a port that is no number or out of range, a host that is
        # no name) or a response cut short: the caller's URL or the remote host, not the server.
        raise _bad(part, f"fetching the image failed: {type(e).__name__}: {e}") from None
    return b"".join(chunks)


def _rgb(image):
    """RGB pixels as the processor makes them from the same file offline: transparency composited
    onto white (transformers' ``convert_to_rgb``, which vLLM's image loading matches); a plain
    ``convert("RGB")`` would keep whatever colour transparent pixels happen to hold."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def decode(raw: bytes, part: ImagePart, policy: MediaPolicy):
    """An RGB PIL image from encoded bytes (transparency on white); ApiError 400 if undecodable or
    too large."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw), formats=FORMATS) as image:
            if image.width * image.height > policy.max_pixels:
                raise _bad(
                    part, f"the image is {image.width}x{image.height} pixels, more than {policy.max_pixels}"
                )
            return _rgb(image)  # loads the pixels: a truncated file fails here
    except ApiError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        raise _bad(part, f"the image cannot be decoded ({type(e).__name__}: {e})") from None
