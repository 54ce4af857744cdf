"""Videos in chat requests: vLLM's ``video_url`` content parts to sampled RGB frames, under the operator's limits.

    {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAIGZ0eXBpc29t..."}}

The URL rules are the images' (demo.api.images: data: URLs, http(s) only from
``--allowed-media-domains``, one ``--media-fetch-timeout`` deadline, no redirects), with
``--max-video-bytes`` of encoded bytes. Then, with PyAV (the ``av`` package):

- only the containers in ``CONTAINERS`` (MP4/MOV, Matroska/WebM, AVI) are opened, their first
  video stream read;
- the frame size is bounded as an image's (pixels, aspect ratio, pixels after the processor's
  resize, demo.api.images.check_size), before any frame is decoded;
- the frames handed to the model are the model's own choice: ``sample(metadata)`` gives their
  indices from the stream's frame count and rate (the processor's ``sample_frames`` where it
  samples, ``--video-frames`` spread evenly where it does not, as vLLM:
  demo.model.vision.frame_sampler); more than ``--max-video-frames`` of them is a 400;
- decoding stops after the last frame wanted, and is bounded before anything is sampled or read,
  from the header: at most ``MAX_SOURCE_FRAMES`` frames in the stream and ``MAX_DECODED_PIXELS``
  frames x pixels (a processor's sampling spreads over the whole video, so all of it may be
  decoded); the frames kept at most ``MAX_VIDEO_PIXELS`` (memory: uint8 RGB), and at most
  ``MAX_VIDEO_PROCESSED_PIXELS`` once the processor has resized them (``processed(width,
  height)`` per frame: float32 RGB);
- a stream whose frames change size, or that ends before the frames its header promised, is
  refused;
- decoding a request's videos takes at most ``--video-decode-timeout`` seconds of wall clock
  (one deadline from when the decoding slot is held, checked between packets: one packet's
  decoding is bounded by the frame size limits).

Each refusal is a 400 (``invalid_video``) whose ``param`` names the part.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from demo.api import images
from demo.api.images import ImagePart, MediaPolicy
from demo.errors import ApiError

# av's names of the demuxers allowed (FFmpeg has hundreds: each one more parser of hostile bytes)
CONTAINERS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi")
MAX_SOURCE_FRAMES = 100_000  # frames in the stream (55 min at 30 fps): all may have to be decoded
MAX_DECODED_PIXELS = 2_000_000_000  # frames in the stream x pixels: ~1,000 frames of 1920x1080
MAX_VIDEO_PIXELS = 150_000_000  # frames kept x pixels: ~450 MB of uint8 RGB
MAX_VIDEO_PROCESSED_PIXELS = 64_000_000  # frames kept x pixels after the resize: ~770 MB of float32 RGB


@dataclass(frozen=True)
class Video:
    """Sampled frames of one video and what the processor needs to know of them.

    frames: uint8 ``[frames, height, width, 3]`` (RGB), owned by the caller.
    metadata: transformers' VideoMetadata fields (``total_num_frames``, ``fps``, ``width``,
    ``height``, ``duration``, ``video_backend``, ``frames_indices``: the source frames kept)."""

    frames: np.ndarray
    metadata: dict


def video_parts(messages: list[dict]) -> list[ImagePart]:
    """The video parts of checked chat messages (demo.api.schema), in prompt order."""
    return [
        ImagePart(part["url"], part["param"])
        for m in messages
        if isinstance(m["content"], list)
        for part in m["content"]
        if part["type"] == "video_url"
    ]


def _bad(part: ImagePart, message: str) -> ApiError:
    return ApiError(400, f"{part.param}: {message}", part.param, "invalid_video")


def load_videos(
    parts: list[ImagePart],
    policy: MediaPolicy,
    sample: Callable[[dict], list[int]],
    processed: Callable[[int, int], int] | None = None,
    slots: threading.Semaphore | None = None,
) -> list[Video]:
    """One ``Video`` per part, in order; ApiError 400 naming the first part refused. ``sample``:
    the model's frame indices for a video's metadata; ``processed(width, height)``: pixels the
    processor makes of a frame; ``slots``: held while decoding (demo.api.images.load_images)."""
    if len(parts) > policy.max_videos:
        raise _bad(
            parts[policy.max_videos],
            f"at most {policy.max_videos} videos per request (--limit-mm-per-prompt), got {len(parts)}",
        )
    raw = [images.fetch_bytes(part, policy, policy.max_video_bytes, "video") for part in parts]
    with slots if slots is not None else contextlib.nullcontext():
        deadline = time.monotonic() + policy.video_decode_timeout  # the wait for a slot not counted
        return [decode(data, part, policy, sample, processed, deadline) for data, part in zip(raw, parts)]


def decode(raw: bytes, part: ImagePart, policy: MediaPolicy, sample, processed=None, deadline=None) -> Video:
    """The sampled frames of an encoded video; ApiError 400 when it cannot be decoded, is over a
    limit or is not decoded by ``deadline`` (time.monotonic(); default: ``--video-decode-timeout``
    from now)."""
    if deadline is None:
        deadline = time.monotonic() + policy.video_decode_timeout
    try:
        import av
    except ImportError:  # installed without the demo extra
        raise _bad(part, "this server cannot decode videos: PyAV is not installed (pip install av)") from None

    try:
        with av.open(io.BytesIO(raw), mode="r") as container:
            if container.format.name not in CONTAINERS:
                raise _bad(
                    part, f"the video container {container.format.name!r} is not taken: send MP4, WebM or AVI"
                )
            if not container.streams.video:
                raise _bad(part, "the file holds no video stream")
            return _frames(container, container.streams.video[0], part, policy, sample, processed, deadline)
    except ApiError:
        raise
    except (av.error.FFmpegError, OSError, ValueError, EOFError) as e:
        raise _bad(part, f"the video cannot be decoded ({type(e).__name__}: {e})") from None


def _metadata(container, stream, part: ImagePart) -> dict:
    """The stream's frame count, rate and size as transformers' PyAV reader reads them
    (``stream.frames``, ``average_rate``); a count the header lacks from its duration."""
    fps = float(stream.average_rate) if stream.average_rate else 0.0
    total = int(stream.frames or 0)
    if total <= 0 and fps > 0 and container.duration:  # some containers (WebM) give no count
        total = int(round(container.duration / 1_000_000 * fps))
    if total <= 0 or fps <= 0:
        raise _bad(part, "the video's header gives no frame count and rate")
    width, height = stream.codec_context.width, stream.codec_context.height
    if width < 1 or height < 1:
        raise _bad(part, "the video's header gives no frame size")
    return dict(total_num_frames=total, fps=fps, width=width, height=height, duration=total / fps,
                video_backend="pyav")  # fmt: skip


def _decoded(container, stream, part: ImagePart, policy: MediaPolicy, deadline: float):
    """The stream's frames in order, decoded packet by packet; a 400 naming
    ``--video-decode-timeout`` once ``deadline`` has passed."""
    for packet in container.demux(stream):  # its last packet is empty: decoding it flushes
        if time.monotonic() > deadline:
            raise _bad(
                part,
                f"decoding the video took longer than {policy.video_decode_timeout:g} s "
                "(--video-decode-timeout): send a shorter or smaller video",
            )
        yield from _decode_packet(packet)


def _decode_packet(packet) -> list:
    return packet.decode()


def _frames(container, stream, part: ImagePart, policy: MediaPolicy, sample, processed, deadline) -> Video:
    meta = _metadata(container, stream, part)
    width, height = meta["width"], meta["height"]
    images.check_size(width, height, part, policy, processed, "video")
    total = meta["total_num_frames"]  # from the header: bounded before anything is sampled or read
    if total > MAX_SOURCE_FRAMES or total * width * height > MAX_DECODED_PIXELS:
        raise _bad(
            part,
            f"the video is too long to decode: {total} frames of {width}x{height} (at most "
            f"{MAX_SOURCE_FRAMES} frames and {MAX_DECODED_PIXELS} pixels)",
        )
    try:
        indices = [int(i) for i in sample(dict(meta))]  # in the processor's order (repeats kept)
    except Exception as e:  # the processor's sampling refuses this video (too short for it: a
        # ValueError, or Qwen2-VL's ZeroDivisionError for a single frame)
        raise _bad(part, f"the model's frame sampling refuses this video ({type(e).__name__}: {e})") from None
    wanted = sorted(set(indices))  # what is decoded
    if not wanted or wanted[0] < 0 or wanted[-1] >= meta["total_num_frames"]:
        raise _bad(part, f"the model's frame sampling gave no usable frames of {meta['total_num_frames']}")
    if len(indices) > policy.max_video_frames:
        raise _bad(
            part,
            f"the model would be handed {len(indices)} frames of this video ({meta['total_num_frames']} "
            f"frames at {meta['fps']:g} fps), more than {policy.max_video_frames} (--max-video-frames): "
            "send a shorter video or one of a lower frame rate",
        )
    after = (processed(width, height) if processed is not None else width * height) * len(indices)
    if after > MAX_VIDEO_PROCESSED_PIXELS:
        raise _bad(
            part,
            f"the model's processor would make {after} pixels of this video's {len(indices)} frames of "
            f"{width}x{height}, more than {MAX_VIDEO_PROCESSED_PIXELS}: send a shorter or smaller video",
        )
    if len(indices) * width * height > MAX_VIDEO_PIXELS:
        raise _bad(
            part,
            f"the video's {len(indices)} frames of {width}x{height} to keep are more than "
            f"{MAX_VIDEO_PIXELS} pixels: send a shorter or smaller video",
        )
    keep, frames, read = set(wanted), {}, 0
    for frame in _decoded(container, stream, part, policy, deadline):
        if (frame.width, frame.height) != (width, height):
            raise _bad(
                part, f"frame {read} is {frame.width}x{frame.height}, the stream says {width}x{height}"
            )
        if read in keep:
            frames[read] = frame.to_ndarray(format="rgb24")
        read += 1
        if read > wanted[-1]:
            break
    if len(frames) < len(wanted):
        raise _bad(part, f"the video ends after {read} frames, its header says {meta['total_num_frames']}")
    return Video(np.stack([frames[i] for i in indices]), {**meta, "frames_indices": indices})
