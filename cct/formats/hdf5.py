"""Reading HDF5 files that may be damaged or not what they claim: weights,
solver states, HDF5Data sources.

An h5py or HDF5 failure anywhere inside `reading(...)` (HDF5 reads a damaged
file lazily, so a bad B-tree shows up at a later lookup, as an OSError,
RuntimeError, KeyError, ...) becomes the caller's CctError naming the file;
`dataset(...)` checks that a name holds a dataset of numbers before a byte of
it is read, so the caller can check its shape first: a dataset declared as
2^31 floats costs HDF5 nothing on disk and numpy 8 GiB to read.
"""
import contextlib

from cct.core.errors import CctError

# What h5py raises for a file it cannot read, or an object of another kind.
READ_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError)


@contextlib.contextmanager
def reading(path, error, kind="HDF5 file", where=""):
    """The file at `path` open for reading; any HDF5 failure in the block is
    raised as `error` (a CctError class) naming the file, after `where` (a
    prefix such as "layer 'data' (HDF5Data): ")."""
    import h5py
    try:
        with h5py.File(path, "r") as handle:
            yield handle
    except CctError:
        raise
    except FileNotFoundError:
        raise error(f"{where}{kind} {str(path)!r} not found") from None
    except READ_ERRORS as failure:
        raise error(f"{where}{path}: not a readable {kind}: {failure}") from None


def dataset(group, name, error, where):
    """group[name], which must be a dataset of numbers (not read yet)."""
    import h5py
    item = group.get(name)
    if item is None:
        raise error(f"{where}: '{name}' is missing")
    if not isinstance(item, h5py.Dataset):
        raise error(f"{where}: '{name}' is a group, expected a dataset")
    if item.dtype.kind not in "biuf":
        raise error(f"{where}: dataset '{name}' holds {item.dtype}, expected numbers")
    return item


def group(parent, name, error, where):
    """parent[name], which must be a group."""
    import h5py
    item = parent.get(name)
    if not isinstance(item, h5py.Group):
        raise error(f"{where}: '{name}' is {'missing' if item is None else 'a dataset'}, expected a group")
    return item
