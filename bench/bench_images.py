"""Decode + resize throughput of Caffe's image path in cct (cct.data.images:
OpenCV's imdecode and INTER_LINEAR resize) against the Pillow path it replaced
(Image.open, convert, BILINEAR resize with antialiasing, copied below as it
was), side by side in one process: the two alternate round after round, so load
on a shared machine hits both alike, and the ratio is taken per round.

    python bench/bench_images.py [--rounds 15] [--repeat 5] [--sizes 256x256,48x64] [--cv-threads N]

Images: the photos and large PNG of tests/data/caffe_images (cat.jpg,
cat gray.jpg, fish-bike.jpg: 480x360 JPEGs; checker_large.png: 501x403), read
from the page cache, as convert_imageset and ImageData read them. A size is
HxW; 0x0 decodes only. Each case reads in colour and in grey (is_color false).
Reported: images/s per path (median over rounds of `repeat` passes over the
images) and the per-round ratio new / old (median).
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "caffe_images", "images")
NAMES = ["cat.jpg", "cat gray.jpg", "fish-bike.jpg", "checker_large.png"]


def pillow_read_image(path, new_height=0, new_width=0, is_color=True):
    """cct's read_image before OpenCV (cct/data/transformer.py at 7593a9b), minus its error handling."""
    from PIL import Image
    with Image.open(path) as image:
        image.load()
        if new_height > 0 and new_width > 0:
            image = image.convert("L" if not is_color else "RGB")
            image = image.resize((new_width, new_height), Image.BILINEAR)
        if is_color:
            array = np.asarray(image.convert("RGB"))[:, :, ::-1].transpose(2, 0, 1)
        else:
            array = np.asarray(image.convert("L"))[None]
        return np.ascontiguousarray(array)


def images_per_second(read, paths, height, width, is_color, repeat):
    start = time.perf_counter()
    for _ in range(repeat):
        for path in paths:
            read(path, height, width, is_color)
    return repeat * len(paths) / (time.perf_counter() - start)


def run_case(paths, height, width, is_color, rounds, repeat):
    """(median images/s of the OpenCV path, of the Pillow path, median per-round ratio)."""
    from cct.data.images import read_image
    new, old = [], []
    for read in (read_image, pillow_read_image):                 # warm-up: imports, page cache
        images_per_second(read, paths, height, width, is_color, 1)
    for _ in range(rounds):
        new.append(images_per_second(read_image, paths, height, width, is_color, repeat))
        old.append(images_per_second(pillow_read_image, paths, height, width, is_color, repeat))
    ratios = [n / o for n, o in zip(new, old)]
    return statistics.median(new), statistics.median(old), statistics.median(ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15, help="alternating rounds per case")
    parser.add_argument("--repeat", type=int, default=5, help="passes over the images per round")
    parser.add_argument("--sizes", default="256x256,48x64,0x0", help="HxW resize targets; 0x0: decode only")
    parser.add_argument("--cv-threads", type=int, default=None, help="cv2.setNumThreads (default: OpenCV's)")
    args = parser.parse_args()
    import cv2
    import PIL
    if args.cv_threads is not None:
        cv2.setNumThreads(args.cv_threads)
    paths = [os.path.join(FOLDER, name) for name in NAMES]
    print(common.machine_line())
    print(f"OpenCV {cv2.__version__} ({cv2.getNumThreads()} threads), Pillow {PIL.__version__}; "
          f"{len(paths)} images, {args.rounds} rounds x {args.repeat} passes")
    print("| resize to | read as | OpenCV images/s | Pillow images/s | OpenCV / Pillow |")
    print("|---|---|---|---|---|")
    for size in args.sizes.split(","):
        height, width = (int(v) for v in size.split("x"))
        for is_color in (True, False):
            new, old, ratio = run_case(paths, height, width, is_color, args.rounds, args.repeat)
            target = f"{height}x{width}" if height else "(decode only)"
            print(f"| {target} | {'colour' if is_color else 'grey'} | {new:.0f} | {old:.0f} | {ratio:.2f} |",
                  flush=True)
    print(f"load {common.load_average():.2f} at the end")


if __name__ == "__main__":
    main()
