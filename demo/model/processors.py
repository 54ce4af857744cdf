"""A vision-language checkpoint's processor, built without its video processor where torchvision is missing.

    processor = load_processor(name_or_path, config, kwargs)   # AutoProcessor's, or the same less videos

transformers (5.x) implements video processors on torchvision only: a Qwen2-VL, Qwen2.5-VL,
Qwen3-VL or LLaVA-OneVision processor cannot even be constructed without it (its
``video_processor`` argument is type-checked against a class that is then not exported), although
the image processors these families need have PIL/numpy versions (``Qwen2VLImageProcessorPil``,
``LlavaOnevisionImageProcessorPil``) that AutoImageProcessor picks by itself.

So when ``AutoProcessor.from_pretrained`` fails and torchvision is not importable, the checkpoint's
processor class is loaded again as a subclass whose attributes (``ProcessorMixin.get_attributes``,
read from ``__init__``'s parameters) leave out every video processor: ``from_pretrained`` then
loads the image processor and tokenizer as usual, with the checkpoint's chat template and
processor options, and the processor has no ``video_processor`` attribute (its ``__call__``
skips videos without one: callers must refuse videos first, ``has_videos``). One log line says
videos need torchvision. Nothing here is per family.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_VIDEO = "video_processor"


def has_videos(processor) -> bool:
    """Whether ``processor`` can process videos (it has a video processor)."""
    return getattr(processor, _VIDEO, None) is not None


def videos_dropped(processor) -> bool:
    """Whether ``processor`` was built without the video processor its class has (``without_videos``)."""
    return getattr(type(processor), "_radixkv_without_videos", False)


def _torchvision_missing() -> bool:
    from transformers.utils import is_torchvision_available

    return not is_torchvision_available()


def without_videos(cls):
    """A subclass of the processor class ``cls`` whose sub-processors exclude its video processors
    (same name and module, so its messages and saved configs read as the original's)."""
    attributes = [a for a in cls.get_attributes() if "video" not in a]
    names = {"__module__": cls.__module__, "_radixkv_without_videos": True}
    return type(cls.__name__, (cls,), {**names, "get_attributes": classmethod(lambda _: attributes)})


def load_processor(name_or_path: str, config, kwargs: dict):
    """The checkpoint's ``AutoProcessor``; where that fails for want of torchvision and the
    processor class (transformers' mapping for ``config``) has a video processor, the same class
    without it (``without_videos``), with one log line. Other failures raise as they are."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except Exception as error:
        if not _torchvision_missing():
            raise
        cls = _processor_class(config)
        if cls is None or not any("video" in a for a in cls.get_attributes()):
            raise
        try:
            processor = without_videos(cls).from_pretrained(name_or_path, **kwargs)
        except Exception:
            raise error from None
    log.warning(
        "%s: serving images without the video processor: videos need torchvision (pip install "
        "torchvision matching your torch); video parts are refused",
        cls.__name__,
    )
    return processor


def _processor_class(config):
    """The processor class transformers maps ``config``'s model type to, or None."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

    try:
        return PROCESSOR_MAPPING[type(config)]
    except (KeyError, ValueError, AttributeError):
        return None
