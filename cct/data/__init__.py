"""Datasets: LMDB/LevelDB access, Caffe's image pipeline through OpenCV
(images.py), Caffe's data transformer, and the embedded digits set (digits.npz)."""
