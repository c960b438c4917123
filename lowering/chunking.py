"""The lowerings' workspace sizes, and batch chunking under a memory budget.

A lowering function asks its `ws` (cct.core.workspace: FRESH, or the running
thread's Arena) for every big intermediate (padded input, lowered matrix, GEMM
product, unlifted gradient) by slot name; `slot_bytes` says how much one call
asks for, so a chunk of images can be sized to fit the budget.

A batch whose workspace (lowered matrix, GEMM product, padded input, output:
`slot_bytes`) would exceed the budget (default 64 MB; the run settings'
lowering_budget_mb) is processed in chunks of whole images, one after
another (`chunk_size`), so the arena never holds more than the budget: CaffeNet
conv1 at batch 256 under type 1 would need 1.1 GB for its lowered matrix alone.
"""
import functools
from typing import Dict, List, Tuple

from .geometry import ConvGeometry
from .type1 import band_values, batch_inner, image_major

# 64 MB: CaffeNet training at batch 256 then peaks within Caffe's 2.7 GB, at most a few % slower
# than with 256 MB (BENCHMARKS.md, "Targets and where we stand").
DEFAULT_BUDGET_MB = 64


def slot_bytes(geom: ConvGeometry, lowering_type: int, batch: int, itemsize: int) -> Dict[str, int]:
    """{slot: bytes} that one call of a lowering type on `batch` images asks its
    workspace for, forward and backward (see the slots in each type's docstring)."""
    c, o = geom.channels, geom.num_output
    kh, kw = geom.kernel_h, geom.kernel_w
    pixels = batch * geom.out_h * geom.out_w
    frame = batch * geom.padded_h * geom.padded_w
    if lowering_type == 1:
        sizes = {"lowered": c * kh * kw * pixels, "product": o * pixels}
    elif lowering_type == 2:
        rows = batch * geom.padded_h * geom.out_w
        sizes = {"lowered": c * kw * rows, "product": o * kh * rows}
    else:
        sizes = {"product": o * kh * kw * frame}
    sizes.update(padded=c * frame, output=o * pixels)
    return {slot: count * itemsize for slot, count in sizes.items()}


def band_slot_bytes(geom: ConvGeometry, rows: int, itemsize: int, pieces: int = 1) -> Dict[str, int]:
    """{slot: bytes} of a one-image type-1 forward in bands of `rows` output
    rows (cct.lowering.type1.forward_in_bands) in `pieces` pieces at once:
    the padded frame and one band's lowered matrix a piece; the bands' GEMMs
    write the output itself."""
    return {"lowered": pieces * band_values(geom, rows) * itemsize,
            "padded": geom.channels * geom.padded_h * geom.padded_w * itemsize}


def image_bytes(geom: ConvGeometry, lowering_type: int, itemsize: int) -> int:
    """Workspace bytes per image of a lowering type."""
    return sum(slot_bytes(geom, lowering_type, 1, itemsize).values())


@functools.lru_cache(maxsize=4096)
def chunk_size(geom: ConvGeometry, lowering_type: int, batch: int, itemsize: int, budget: int) -> int:
    """Images per chunk so that the chunk's whole workspace fits `budget` bytes
    (at least one image, at most the batch). Remembered: the chooser asks it
    for every type on every nominal machine it prices a shape on."""
    per_image = image_bytes(geom, lowering_type, itemsize)
    if not per_image:                  # no input channels: nothing is lowered
        return int(max(1, batch))
    return int(max(1, min(batch, budget // per_image)))


CACHE_BYTES = 8 * 2 ** 20          # a lowered chunk this small is still in cache when its GEMM reads it
MIN_GEMM_COLUMNS = 4096            # ... but keep the GEMM wide enough to run at its full rate


def cache_chunk(geom: ConvGeometry, lowering_type: int, batch: int, itemsize: int) -> int:
    """Images per chunk for speed: type 1 on large images (CaffeNet conv1: 4.4 MB
    lowered per image) runs ~15% faster forward when its lowered matrix is
    consumed by the GEMM while still in cache, rather than written to memory for
    the whole batch and read back. Chunks keep at least MIN_GEMM_COLUMNS GEMM
    columns; other types, and type 1 on small images (batch-inner, see type1),
    measured fastest whole, and so does type 1 image by image (each image's
    columns are in cache when its own GEMM reads them)."""
    if lowering_type != 1 or batch_inner(geom, batch) or image_major(geom, batch):
        return batch
    pixels = geom.out_h * geom.out_w
    lowered = geom.channels * geom.kernel_h * geom.kernel_w * pixels * itemsize
    if not lowered:                    # no input channels: an empty matrix, one chunk
        return batch
    images = max(CACHE_BYTES // lowered, -(-MIN_GEMM_COLUMNS // pixels), 1)
    return int(min(batch, images))


def chunks(batch: int, size: int) -> List[Tuple[int, int]]:
    """[(start, stop)] covering range(batch) in steps of `size`."""
    return [(start, min(start + size, batch)) for start in range(0, batch, size)]
