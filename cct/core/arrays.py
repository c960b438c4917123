"""The array types cct's annotations name (numpy.typing), so that a signature
says what dtype it takes once, in the same words everywhere."""
from typing import Any, Tuple

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]                      # any dtype: bytes, masks, a blob of either float type
FloatArray = npt.NDArray[np.floating[Any]]    # float32 or float64: a blob's data or diff, what a lowering takes
Float32Array = npt.NDArray[np.float32]        # float32 only: Winograd's U, its transforms' buffers
Shape = Tuple[int, ...]                       # an array's shape, as numpy gives it
