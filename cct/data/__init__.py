"""Datasets: LMDB/LevelDB access, Caffe's data transformer and image decoding,
and the embedded digits set (digits.npz)."""
