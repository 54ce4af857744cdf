"""Images in chat requests: OpenAI ``image_url`` content parts to PIL images, under the operator's limits.

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBOR..."}}

- ``data:`` URLs (base64) are decoded here, nothing is fetched;
- ``http(s)`` URLs are refused unless their host is in ``--allowed-media-domains`` (vLLM's flag;
  a server that fetches any URL for anonymous callers reaches its own network: SSRF). Allowed
  ones are fetched within ``--media-fetch-timeout`` seconds, one deadline from the name lookup
  to the last byte (demo.api.media_fetch), and ``--max-image-bytes``, without following
  redirects (a redirect may point anywhere); a URL that does not even parse is a 400 too;
- any other scheme (``file:``, ``ftp:``) is refused;
- at most ``--limit-mm-per-prompt`` images per request (vLLM's flag: ``image=4`` or
  ``{"image": 4}``), each at most ``--max-image-bytes`` of encoded bytes and ``MAX_PIXELS`` pixels
  (a small PNG can claim a huge canvas), decoded by Pillow as PNG, JPEG, GIF, WebP or BMP;
- what an image costs once the model's processor has resized it is bounded before any pixel
  is decoded, from the size in the file's header: an aspect ratio of at most
  ``MAX_ASPECT_RATIO`` (Qwen2-VL's limit) and at most ``MAX_PROCESSED_PIXELS`` pixels after
  resizing (``processed(width, height)``, demo.model.vision.processed_pixels). A 553-byte PNG
  of 1x120,000 pixels is cheap to decode, but a processor that scales its short side up to
  336 builds a 336 x 40M array;
- decoding and processing run in at most ``processing_slots`` requests at once (``slots``:
  an app's semaphore), so a burst of small images cannot add up to the server's memory.

Each refusal is a 400 whose ``param`` names the part (``messages[0].content[1]``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import json
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass

from demo.api import media_fetch
from demo.errors import ApiError

MAX_PIXELS = 40_000_000  # per image, width x height (Pillow's own bomb guard is ~179 M)
MAX_ASPECT_RATIO = 200.0  # long side / short side (Qwen2-VL refuses more)
MAX_PROCESSED_PIXELS = 16_000_000  # per image after the processor's resize (~190 MB in float32 RGB)
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")


@dataclass(frozen=True)
class ImagePart:
    """An ``image_url`` content part: its URL and where it sat (for error messages)."""

    url: str
    param: str  # e.g. "messages[0].content[1]"


VIDEO_FRAMES = 32  # frames sampled evenly from a video by default (vLLM's VideoMediaIO num_frames)


@dataclass(frozen=True)
class MediaPolicy:
    max_images: int = 4  # per request (vLLM: --limit-mm-per-prompt)
    max_image_bytes: int = 8 << 20  # encoded bytes of one image (decoded data: URL or download)
    allowed_domains: tuple[str, ...] = ()  # hosts http(s) images may come from; () = none
    fetch_timeout: float = 5.0  # seconds for one whole download
    max_pixels: int = MAX_PIXELS
    max_aspect_ratio: float = MAX_ASPECT_RATIO
    max_processed_pixels: int = MAX_PROCESSED_PIXELS
    processing_slots: int = 2  # requests decoding or processing images (or videos) at once
    # Videos (demo.api.videos): per request, encoded bytes of one, frames handed to the model
    max_videos: int = 1
    max_video_bytes: int = 32 << 20
    max_video_frames: int = 64
    # frames sampled evenly where the processor samples none; None: VIDEO_FRAMES (vLLM's
    # num_frames), or --max-video-frames where that is lower (sampled_frames)
    video_frames: int | None = None
    video_decode_timeout: float = 30.0  # seconds for decoding one request's videos

    def __post_init__(self) -> None:
        if self.video_frames is not None and not 1 <= self.video_frames <= self.max_video_frames:
            raise ValueError(
                f"--video-frames must be >= 1 and at most --max-video-frames ({self.max_video_frames}), "
                f"got {self.video_frames}"
            )
        if not self.video_decode_timeout > 0:
            raise ValueError(f"--video-decode-timeout must be > 0, got {self.video_decode_timeout}")
        if self.max_videos < 0 or self.max_video_bytes < 1 or self.max_video_frames < 1:
            raise ValueError(
                "the video limit of --limit-mm-per-prompt must be >= 0, --max-video-bytes and "
                f"--max-video-frames >= 1, got {self.max_videos}, {self.max_video_bytes}, {self.max_video_frames}"
            )
        if self.processing_slots < 1 or self.max_processed_pixels < 1 or not self.max_aspect_ratio >= 1:
            raise ValueError(
                "processing_slots and max_processed_pixels must be >= 1 and max_aspect_ratio >= 1, got "
                f"{self.processing_slots}, {self.max_processed_pixels}, {self.max_aspect_ratio}"
            )
        if self.max_images < 0 or self.max_image_bytes < 1 or self.fetch_timeout <= 0 or self.max_pixels < 1:
            raise ValueError(
                "limit-mm-per-prompt must be >= 0, max-image-bytes >= 1 and media-fetch-timeout > 0, got "
                f"{self.max_images}, {self.max_image_bytes}, {self.fetch_timeout}"
            )

    @property
    def sampled_frames(self) -> int:
        """Frames sampled evenly from a video whose processor samples none (demo.model.vision.frame_sampler)."""
        return (
            self.video_frames if self.video_frames is not None else min(VIDEO_FRAMES, self.max_video_frames)
        )

    @property
    def body_bytes(self) -> int:
        """A request body limit that fits ``max_images`` images and ``max_videos`` videos as
        base64 data: URLs plus text."""
        images = self.max_images * (4 * -(-self.max_image_bytes // 3) + 1024)
        return (1 << 20) + images + self.max_videos * (4 * -(-self.max_video_bytes // 3) + 1024)


def parse_limit_mm(text: str) -> dict[str, int]:
    """Items per request by medium from ``image=N``, ``image=N,video=M`` or ``{"image": N, "video": M}``
    (vLLM's forms); only the media named; ValueError else."""
    text = text.strip()
    try:
        limits = json.loads(text) if text.startswith("{") else dict(p.split("=", 1) for p in text.split(","))
    except ValueError:
        limits = None
    if not isinstance(limits, dict) or not limits or not set(limits) <= {"image", "video"}:
        raise ValueError(
            f'--limit-mm-per-prompt takes image=N,video=M or {{"image": N, "video": M}}, got {text!r}'
        )
    out = {}
    for medium, value in limits.items():
        try:
            out[medium] = int(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"--limit-mm-per-prompt: the {medium} limit must be an integer, got {text!r}"
            ) from None
        if out[medium] < 0:
            raise ValueError(f"--limit-mm-per-prompt: the {medium} limit must be >= 0, got {out[medium]}")
    return out


def image_parts(messages: list[dict]) -> list[ImagePart]:
    """The image parts of checked chat messages (demo.api.schema), in prompt order."""
    return [
        ImagePart(part["url"], part["param"])
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] == "image_url"
    ]


def _bad(part: ImagePart, message: str, noun: str = "image") -> ApiError:
    return ApiError(400, f"{part.param}: {message}", part.param, f"invalid_{noun}")


def load_images(
    parts: list[ImagePart],
    policy: MediaPolicy,
    processed: Callable[[int, int], int] | None = None,
    slots: threading.Semaphore | None = None,
) -> list:
    """One PIL image (RGB) per part, in order; ApiError 400 naming the first part refused.
    ``processed(width, height)``: the pixels the model's processor makes of such an image;
    ``slots``: held while decoding (not while fetching: a download costs no memory to speak of)."""
    if len(parts) > policy.max_images:
        raise _bad(
            parts[policy.max_images],
            f"at most {policy.max_images} images per request (--limit-mm-per-prompt), got {len(parts)}",
        )
    raw = [fetch_bytes(part, policy) for part in parts]
    with slots if slots is not None else contextlib.nullcontext():
        return [decode(data, part, policy, processed) for data, part in zip(raw, parts)]


def fetch_bytes(
    part: ImagePart, policy: MediaPolicy, max_bytes: int | None = None, noun: str = "image"
) -> bytes:
    """The part's encoded bytes, from a data: URL or an allowed http(s) host, at most ``max_bytes``
    (default the policy's ``max_image_bytes``); ``noun`` names the medium in errors ("video")."""
    url = part.url
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if max_bytes is None:
        max_bytes = policy.max_image_bytes
    if scheme == "data":
        return _data_url(part, max_bytes, noun)
    if scheme not in ("http", "https"):
        raise _bad(part, f"the {noun} URL must be a data: URL (base64) or http(s)", noun)
    try:  # a bracketed host that is no IP address, a netloc changed by NFKC, a bad port...
        split = urllib.parse.urlsplit(url)
        host, _ = (split.hostname or "").lower(), split.port
    except ValueError as e:
        raise _bad(part, f"the {noun} URL is malformed: {e}", noun) from None
    if host not in policy.allowed_domains:
        raise _bad(
            part,
            f"fetching {noun}s from {host or 'that URL'!r} is not allowed on this server: send the {noun} "
            "as a data: URL (operators allow hosts with --allowed-media-domains)",
            noun,
        )
    return _download(part, policy, split, max_bytes, noun)


def _too_large(part: ImagePart, max_bytes: int, noun: str) -> ApiError:
    return _bad(part, f"the {noun} is larger than {max_bytes} bytes (--max-{noun}-bytes)", noun)


def _data_url(part: ImagePart, max_bytes: int, noun: str) -> bytes:
    head, comma, data = part.url.partition(",")
    if not comma or not head.lower().endswith(";base64"):
        example = "data:image/png;base64,<data>" if noun == "image" else "data:video/mp4;base64,<data>"
        raise _bad(part, f"a data: URL must look like {example}", noun)
    if len(data) > 4 * -(-max_bytes // 3) + 4:
        raise _too_large(part, max_bytes, noun)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(part, "the data: URL is not valid base64", noun) from None
    if len(raw) > max_bytes:
        raise _too_large(part, max_bytes, noun)
    return raw


def _download(
    part: ImagePart, policy: MediaPolicy, split: urllib.parse.SplitResult, max_bytes: int, noun: str
) -> bytes:
    """GET the part's URL within the policy's one deadline and ``max_bytes`` (demo.api.media_fetch)."""
    path = split.path + (f"?{split.query}" if split.query else "")
    try:
        return media_fetch.fetch(
            path,
            split.scheme.lower(),
            split.hostname,
            split.port,
            time.monotonic() + policy.fetch_timeout,
            max_bytes,
            f"{noun}/*",
        )
    except TimeoutError:
        raise _bad(part, f"fetching the {noun} took longer than {policy.fetch_timeout} s", noun) from None
    except media_fetch.TooLarge:
        raise _too_large(part, max_bytes, noun) from None
    except media_fetch.FetchError as e:
        raise _bad(part, f"fetching the {noun} failed: {e}", noun) from None


def _rgb(image):
    """RGB pixels as the processor makes them from the same file offline: transparency composited
    onto white (transformers' ``convert_to_rgb``, which vLLM's image loading matches); a plain
    ``convert("RGB")`` would keep whatever colour transparent pixels happen to hold."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def check_size(
    width: int, height: int, part: ImagePart, policy: MediaPolicy, processed=None, noun: str = "image"
) -> None:
    """ApiError 400 unless a ``width`` x ``height`` image (or a video's frames: ``noun="video"``)
    is within the policy's bounds: pixels, aspect ratio, and pixels after the processor's resize
    (``processed(width, height)``)."""
    subject = "the image is" if noun == "image" else f"the {noun}'s frames are"
    if width * height > policy.max_pixels:
        raise _bad(part, f"{subject} {width}x{height} pixels, more than {policy.max_pixels}", noun)
    if max(width, height) > policy.max_aspect_ratio * max(1, min(width, height)):
        raise _bad(
            part,
            f"{subject} {width}x{height} pixels, an aspect ratio over {policy.max_aspect_ratio:g}:1",
            noun,
        )
    after = processed(width, height) if processed is not None else width * height
    if after > policy.max_processed_pixels:
        raise _bad(
            part,
            f"{subject} {width}x{height} pixels: the model's processor would make {after} pixels of "
            f"{'it' if noun == 'image' else 'each'}, more than {policy.max_processed_pixels}",
            noun,
        )


def decode(raw: bytes, part: ImagePart, policy: MediaPolicy, processed=None):
    """An RGB PIL image from encoded bytes (transparency on white); ApiError 400 if undecodable or
    too costly (``check_size``, from the header, before the pixels are decoded)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(raw), formats=FORMATS) as image:
            check_size(image.width, image.height, part, policy, processed)
            return _rgb(image)  # loads the pixels: a truncated file fails here
    except ApiError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError) as e:
        raise _bad(part, f"the image cannot be decoded ({type(e).__name__}: {e})") from None
