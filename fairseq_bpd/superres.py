"""superres_blockwise: image super-resolution as sequence transduction (Stern et al. 2018, section 7.2).

A low-resolution image's pixels in raster order are the source, the high-resolution
image's pixels the target, each pixel a token whose symbol is its intensity. The model,
criterion and blockwise generator are translation_blockwise's; what is new is that the
dictionary is numeric (so --blockwise-distance E can accept a proposal within E
intensity levels of greedy's choice, the paper's approximate acceptance) and that every
output has the image's pixel count. The data directory comes from
scripts/prepare_digits.py, whose image.json gives the shapes.
"""
import json
import os

from fairseq import utils
from fairseq.tasks import register_task

from .acceptance import symbol_numbers
from .task import TranslationBlockwiseConfig, TranslationBlockwiseTask

IMAGE_INFO = "image.json"  # {"low": [h, w], "high": [H, W], "levels": L}


def read_image_info(data):
    """The shapes scripts/prepare_digits.py wrote beside the binarised data: a dict."""
    path = os.path.join(utils.split_paths(data)[0], IMAGE_INFO)
    if not os.path.exists(path):
        raise FileNotFoundError(f"superres_blockwise: {path} not found; make the data with scripts/prepare_digits.py")
    with open(path) as f:
        info = json.load(f)
    if not all(len(info.get(key, ())) == 2 for key in ("low", "high")):
        raise ValueError(f"superres_blockwise: {path} must give 'low' and 'high' as [height, width]")
    return info


@register_task("superres_blockwise", dataclass=TranslationBlockwiseConfig)
class SuperResolutionTask(TranslationBlockwiseTask):
    """TranslationBlockwiseTask over pixel intensities: fixed-size outputs, a numeric dictionary."""

    @classmethod
    def setup_task(cls, cfg, **kwargs):
        task = super().setup_task(cfg, **kwargs)
        task.image_info = read_image_info(cfg.data)
        try:
            symbol_numbers(task.target_dictionary)
        except ValueError as error:
            raise ValueError(f"superres_blockwise: dict.{cfg.target_lang}.txt must list intensities, "
                             f"but its {error}") from None
        return task

    @property
    def pixels(self):
        height, width = self.image_info["high"]
        return height * width

    def build_generator(self, models, args, *rest, **kwargs):
        # Every image has the same pixel count: exactly that many tokens, then EOS,
        # for greedy and blockwise decoding alike.
        args.min_len, args.max_len_a, args.max_len_b = self.pixels, 0, self.pixels
        return super().build_generator(models, args, *rest, **kwargs)
