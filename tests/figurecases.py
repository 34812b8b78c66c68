"""Reading the report figures back: the thumbnails of a grid are one pixel array, each framed by a gid'd rectangle."""

from __future__ import annotations

from typing import Any

import numpy as np


def cell_pixels(figure: Any, frame: Any, side: int) -> np.ndarray:
    """``(side, side, 3)``: the figure's pixels at the centres of a ``side x side`` image filling ``frame``'s box."""
    pixels = figure.images[0].get_array()  # (H, W, 3), row 0 at the top, placed as it is
    height, width = pixels.shape[:2]
    x0, y0 = frame.get_x() * width, (1 - frame.get_y() - frame.get_height()) * height
    step = frame.get_width() * width / side
    centres = ((np.arange(side) + 0.5) * step).astype(int)
    return pixels[np.ix_(round(y0) + centres, round(x0) + centres)]
