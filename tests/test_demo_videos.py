"""video_url parts without a model (demo.api.videos): PyAV decoding of small videos written by
the test, the model's frame sampling (transformers' own sampling function), and every limit as a
clear 400 naming the part. (Over HTTP: tests/test_demo_vlm_families.py.)"""

from __future__ import annotations

import base64

import numpy as np
import pytest
from transformers.video_utils import VideoMetadata, default_sample_indices_fn

from demo.api import schema, videos
from demo.api.images import ImagePart, MediaPolicy
from demo.config import Config, from_args
from demo.errors import ApiError
from demo.model.vision import frame_sampler
from tests.demo_checkpoints import data_url, png
from tests.demo_vlm_checkpoints import decoded, mp4

PART = ImagePart("", "messages[0].content[1]")


def every(metadata: dict) -> list[int]:
    return list(range(metadata["total_num_frames"]))


def uniform(n: int):
    """Sampling as a processor that samples ``n`` frames does (BaseVideoProcessor.sample_frames)."""
    return lambda metadata: default_sample_indices_fn(VideoMetadata(**metadata), num_frames=n).tolist()


def load(raw: bytes, sample=every, policy: MediaPolicy | None = None, mime: str = "video/mp4", **limits):
    part = ImagePart(data_url(raw, mime), PART.param)
    return videos.load_videos([part], policy or MediaPolicy(**limits), sample)[0]


def refused(match: str, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError, match=match) as e:
        load(*args, **kwargs)
    assert e.value.status == 400 and e.value.param == PART.param and e.value.code == "invalid_video"
    return e.value


@pytest.mark.parametrize("container", ["mp4", "matroska", "avi"])
def test_sampled_frames_are_the_decoded_frames_at_the_models_indices(container):
    raw = mp4(1, frames=12, container=container)
    reference, meta = decoded(raw)
    video = load(raw, uniform(4))
    assert video.metadata["frames_indices"] == [0, 3, 6, 9]
    assert np.array_equal(video.frames, reference[[0, 3, 6, 9]]) and video.frames.dtype == np.uint8
    # The metadata the processor reads: transformers' PyAV reader's (a Matroska header gives no
    # frame count: it is read from the duration, where transformers' reader would see 0).
    want = {
        "total_num_frames": 12,
        "fps": 10.0,
        "width": 48,
        "height": 40,
        "duration": 1.2,
        "video_backend": "pyav",
    }
    assert {k: video.metadata[k] for k in want} == want
    if container != "matroska":
        assert meta.total_num_frames == 12
    # Every frame where the model does not sample; a sampling's order and repeats are kept.
    assert np.array_equal(load(raw).frames, reference)
    video = load(raw, lambda metadata: [5, 1, 5])
    assert video.metadata["frames_indices"] == [5, 1, 5] and np.array_equal(
        video.frames, reference[[5, 1, 5]]
    )


class _Processor:
    """A processor whose video processor samples (``sample_frames``) or not: as
    demo.model.vision.frame_sampler reads it."""

    def __init__(self, samples: bool) -> None:
        self.video_processor = self
        self.do_sample_frames = samples

    def sample_frames(self, metadata):
        return default_sample_indices_fn(metadata, num_frames=3)


def test_a_processor_that_samples_none_gets_frames_spread_evenly_as_vllm():
    """300 frames (10 s at 30 fps): 8 frames at linspace(0, 299, 8), the metadata saying so (the
    processor's sampled_fps and Qwen2.5-VL's second_per_grid_ts follow from it)."""
    raw = mp4(7, frames=300, size=(16, 16), fps=30)
    reference, _ = decoded(raw)
    video = load(raw, frame_sampler(_Processor(False), 8), max_video_frames=8)
    want = [0, 42, 85, 128, 170, 213, 256, 299]
    assert video.metadata["frames_indices"] == want == np.linspace(0, 299, 8).astype(int).tolist()
    assert np.array_equal(video.frames, reference[want])
    assert {k: video.metadata[k] for k in ("total_num_frames", "fps", "duration")} == {
        "total_num_frames": 300,
        "fps": 30.0,
        "duration": 10.0,
    }
    meta = VideoMetadata(**video.metadata)
    assert meta.sampled_fps == pytest.approx(0.8) and meta.timestamps[-1] == pytest.approx(299 / 30)
    # A clip of no more frames than the count: every frame, once; the processor's own sampling
    # where it samples (here 3 frames); an odd count is taken as is.
    short = mp4(8, frames=6, size=(16, 16))
    assert load(short, frame_sampler(_Processor(False), 8)).metadata["frames_indices"] == list(range(6))
    assert load(raw, frame_sampler(_Processor(True), 8)).metadata["frames_indices"] == [0, 100, 200]
    assert load(raw, frame_sampler(_Processor(False), 5)).metadata["frames_indices"] == [0, 74, 149, 224, 299]


def test_the_frame_count_flags():
    assert (MediaPolicy().sampled_frames, MediaPolicy(max_video_frames=8).sampled_frames) == (32, 8)
    assert MediaPolicy(video_frames=4, max_video_frames=8).sampled_frames == 4
    for bad in (0, 9):
        with pytest.raises(
            ValueError, match=rf"--video-frames must be >= 1 and at most --max-video-frames \(8\), got {bad}"
        ):
            MediaPolicy(video_frames=bad, max_video_frames=8)
    with pytest.raises(ValueError, match="--video-decode-timeout must be > 0, got 0"):
        Config(video_decode_timeout=0)
    c = from_args(["--video-frames", "16", "--video-decode-timeout", "2.5"], {})
    assert (c.media_policy.sampled_frames, c.media_policy.video_decode_timeout) == (16, 2.5)
    c = from_args([], {"RADIXKV_VIDEO_FRAMES": "6", "RADIXKV_VIDEO_DECODE_TIMEOUT": "9"})
    assert (c.media_policy.sampled_frames, c.media_policy.video_decode_timeout) == (6, 9.0)
    with pytest.raises(ValueError, match="--video-frames"):
        from_args(["--video-frames", "65"], {})  # over the default --max-video-frames 64


def test_decoding_past_its_deadline_is_a_400(monkeypatch):
    """A decoder slower than --video-decode-timeout: cut at the deadline, a 400 naming the flag."""
    import time

    raw = mp4(9, frames=300, size=(16, 16), fps=30)
    real, packets, delay = videos._decode_packet, [], [0.02]

    def slow(packet):
        packets.append(packet)
        time.sleep(delay[0])
        return real(packet)

    monkeypatch.setattr(videos, "_decode_packet", slow)
    every_eighth = frame_sampler(_Processor(False), 8)  # up to the last frame: all of it decoded
    error = refused(
        r"decoding the video took longer than 0.3 s \(--video-decode-timeout\): send a shorter or smaller video",
        raw,
        every_eighth,
        video_decode_timeout=0.3,
    )
    assert error.message.startswith(PART.param) and 0 < len(packets) < 300  # cut short
    packets.clear()
    delay[0] = 0
    video = load(raw, every_eighth, video_decode_timeout=0.3)  # the same stream, decoded in time
    assert video.metadata["frames_indices"][-1] == 299 and len(packets) > 300  # every packet, and the flush


def test_frame_and_video_limits_are_400s():
    raw = mp4(2, frames=12)
    refused(r"handed 12 frames of this video \(12 frames at 10 fps\), more than 8 \(--max-video-frames\): "
            "send a shorter video", raw, max_video_frames=8)  # fmt: skip
    refused(r"handed 10 frames .* more than 8 \(--max-video-frames\): send a shorter", raw, uniform(10),
            max_video_frames=8)  # fmt: skip
    assert load(raw, uniform(8), max_video_frames=8).frames.shape[0] == 8  # sampled down: taken
    refused(r"larger than 1000 bytes \(--max-video-bytes\)", raw, max_video_bytes=1000)
    refused(r"the video's frames are 48x40 pixels, more than 1000", raw, max_pixels=1000)
    refused(r"aspect ratio over 4:1", mp4(3, frames=2, size=(64, 8)), max_aspect_ratio=4.0)
    refused(
        r"frame sampling refuses this video \(ValueError: .*exceeds total_num_frames=12", raw, uniform(20)
    )
    parts = [ImagePart(data_url(raw, "video/mp4"), f"messages[0].content[{i}]") for i in range(2)]
    with pytest.raises(ApiError, match=r"content\[1\]: at most 1 videos per request") as e:
        videos.load_videos(parts, MediaPolicy(), every)
    assert e.value.param == "messages[0].content[1]"
    refused("at most 0 videos", raw, max_videos=0)


def test_decoding_cost_is_bounded_before_decoding(monkeypatch):
    part = ImagePart(data_url(mp4(4, frames=12), "video/mp4"), PART.param)
    upscaled = lambda w, h: 1_000_000  # noqa: E731  (a processor that makes 1 M pixels of each frame)
    with pytest.raises(
        ApiError, match=r"would make 12000000 pixels of this video's 12 frames of 48x40, more than"
    ):
        monkeypatch.setattr(videos, "MAX_VIDEO_PROCESSED_PIXELS", 11_000_000)
        videos.load_videos([part], MediaPolicy(), every, upscaled)
    assert len(videos.load_videos([part], MediaPolicy(), uniform(10), upscaled)[0].frames) == 10
    monkeypatch.setattr(videos, "MAX_VIDEO_PIXELS", 48 * 40 * 3)
    refused(r"the video's 4 frames of 48x40 to keep are more than 5760 pixels", mp4(4, frames=12), uniform(4))
    assert len(load(mp4(4, frames=12), uniform(3)).frames) == 3
    monkeypatch.setattr(videos, "MAX_DECODED_PIXELS", 48 * 40 * 11)
    refused(
        r"too long to decode: 12 frames of 48x40 \(at most 100000 frames and 21120 pixels\)",
        mp4(4, frames=12),
    )
    # A hostile header: a billion 1x1 frames is refused before the sampling lists them.
    real = videos._metadata
    monkeypatch.setattr(videos, "_metadata", lambda *a: {**real(*a), "total_num_frames": 10**9})
    sampled = []
    refused(r"too long to decode: 1000000000 frames", mp4(4, frames=12), lambda m: sampled.append(m) or [0])
    assert sampled == []


def test_hostile_bytes_are_400s():
    refused("cannot be decoded", b"\x00" * 4096)
    refused("cannot be decoded", mp4(5)[:600])  # cut inside the header
    refused("container 'png_pipe' is not taken|cannot be decoded", png(5), mime="image/png")
    refused("not valid base64", b"", mime="video/mp4;base64,@@@@#")  # data:video/mp4;base64,@@@@#;base64,
    with pytest.raises(ApiError, match="must look like data:video/mp4;base64"):
        videos.load_videos([ImagePart("data:video/mp4,abc", "p")], MediaPolicy(), every)
    with pytest.raises(ApiError, match="fetching videos from 'example.com' is not allowed") as e:
        videos.load_videos([ImagePart("https://example.com/v.mp4", "p")], MediaPolicy(), every)
    assert e.value.code == "invalid_video"
    with pytest.raises(ApiError, match="video URL must be a data: URL"):
        videos.load_videos([ImagePart("file:///etc/passwd", "p")], MediaPolicy(), every)


def _growing_mjpeg() -> bytes:
    """An AVI of Motion JPEG whose header says 48x40, its last 3 of 6 frames 96x80 (each JPEG
    frame carries its own size: a decoder follows it)."""
    import io
    from fractions import Fraction

    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="avi") as box:
        stream = box.add_stream("mjpeg", rate=10)
        stream.width, stream.height, stream.pix_fmt = 48, 40, "yuvj420p"
        big = av.CodecContext.create("mjpeg", "w")
        big.width, big.height, big.pix_fmt, big.time_base = 96, 80, "yuvj420p", Fraction(1, 10)
        big.open()
        for i in range(6):
            frame = av.VideoFrame.from_ndarray(
                np.zeros((40, 48, 3) if i < 3 else (80, 96, 3), np.uint8), format="rgb24"
            )
            frame.pts = i
            packets = stream.encode(frame) if i < 3 else big.encode(frame)
            for packet in packets:
                packet.stream = stream
            box.mux(packets)
        box.mux(stream.encode())
    return out.getvalue()


def test_a_video_whose_frames_change_size_or_run_short_is_refused(monkeypatch):
    raw = _growing_mjpeg()
    assert load(raw, lambda m: [0, 2]).frames.shape == (2, 40, 48, 3)  # decoding stops before the change
    refused(r"frame 3 is 96x80, the stream says 48x40", raw)
    with pytest.raises(ApiError, match="frame sampling gave no usable frames of 12"):
        load(mp4(6, frames=12), lambda m: [12])
    # A header that promises more frames than the stream holds.
    real = videos._metadata
    monkeypatch.setattr(videos, "_metadata", lambda *a: {**real(*a), "total_num_frames": 20})
    refused(r"the video ends after 12 frames, its header says 20", mp4(6, frames=12))


def test_a_server_without_pyav_says_so(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "av", None)  # import av: ImportError
    refused(r"cannot decode videos: PyAV is not installed \(pip install av\)", b"\x00" * 64)


def test_schema_takes_video_url_parts_in_user_messages():
    url = "data:video/mp4;base64," + base64.b64encode(b"x").decode()
    content = [{"type": "text", "text": "what happens?"}, {"type": "video_url", "video_url": {"url": url}}]
    req = schema.chat({"messages": [{"role": "user", "content": content}]}, 1024)
    parts = videos.video_parts(req.messages)
    assert parts == [ImagePart(url, "messages[0].content[1]")]
    with pytest.raises(ApiError, match=r"a video_url part must be \{'type': 'video_url'"):
        schema.chat(
            {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": url}]}]}, 1024
        )
    with pytest.raises(ApiError, match="images and videos are taken in user messages only"):
        schema.chat({"messages": [{"role": "system", "content": content}]}, 1024)
