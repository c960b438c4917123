"""The process-wide random generator (Caffe's Caffe::rng_stream), seeded by
cct.set_random_seed or a solver's random_seed. Fillers, Dropout and data
shuffling draw from it, so a seeded run is repeatable."""
import numpy as np

_rng = np.random.default_rng()


def set_random_seed(seed: int) -> None:
    global _rng
    _rng = np.random.default_rng(int(seed))


def get_rng() -> np.random.Generator:
    return _rng
