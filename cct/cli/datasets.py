"""Caffe's dataset tools, as functions of their argument list (no program name)
that return an exit code and raise cct.core.errors.CctError on bad input:

    convert_imageset([FLAGS] ROOTFOLDER/ LISTFILE DB_NAME)
        images listed in LISTFILE (`path label` per line) -> a database of Datums
        keyed `%08d_path`. Flags: --gray, --shuffle, --backend lmdb|leveldb,
        --resize_width, --resize_height, --check_size, --encoded, --encode_type.
    compute_image_mean([FLAGS] INPUT_DB [OUTPUT_FILE])
        the mean image of a database -> a binaryproto. Flag: --backend.

Boolean flags take gflags' forms: --gray, --gray=true, --gray=false.
"""
import argparse
import logging
import os

import numpy as np

from cct.core import rng as cct_rng
from cct.data.images import encode_image, read_image
from cct.data.transformer import array_to_datum, datum_to_array, save_mean_file
from cct.core.progress import Progress
from cct.data.db import LMDB, open_db, record_key
from cct.core.errors import ConfigError, DataError
from cct.formats.prototxt import atomic_path
from cct.proto import caffe_pb2

log = logging.getLogger("cct")


class _Help(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting the process."""

    def error(self, message):
        raise ConfigError(f"{self.prog}: {message}\n{self.format_usage().strip()}")

    def exit(self, status=0, message=None):
        raise _Help(status)


def _flag(text, name, prog):
    value = str(text).lower()
    if value in ("1", "true", "yes", "t", "y"):
        return True
    if value in ("0", "false", "no", "f", "n"):
        return False
    raise ConfigError(f"{prog}: --{name}: expected true or false, got {text!r}")


def _add_bool(parser, name, help_text):
    parser.add_argument(f"--{name}", action="store_true", help=help_text + " (also --X=true|false)")
    parser.bool_flags = getattr(parser, "bool_flags", ()) + (name,)


def _gflags_to_argparse(parser, argv):
    """gflags spellings -> argparse: -flag -> --flag, --flag=false / --noflag drop a
    boolean flag, --flag=true keeps it. Positionals pass through unchanged."""
    bools = getattr(parser, "bool_flags", ())
    known = {a.dest for a in parser._actions}
    out = []
    for token in argv:
        if token.startswith("-") and not token.startswith("--") and token[1:].split("=")[0] in known:
            token = "-" + token
        if token.startswith("--"):
            name, has_value, value = token[2:].partition("=")
            if name in bools and has_value:
                if _flag(value, name, parser.prog):
                    out.append(f"--{name}")
                continue
            if name.startswith("no") and name[2:] in bools and not has_value:
                continue
        out.append(token)
    return out


def _parse(parser, argv):
    try:
        return parser.parse_args(_gflags_to_argparse(parser, list(argv)))
    except _Help:
        return None


# --- convert_imageset -----------------------------------------------------------------
def _convert_imageset_parser():
    parser = _Parser(prog="convert_imageset", description="Convert a set of images to a database of "
                     "Datums, as Caffe's convert_imageset. LISTFILE lines are `subfolder1/file1.JPEG 7`.")
    _add_bool(parser, "gray", "read the images as grayscale (1 channel)")
    _add_bool(parser, "shuffle", "shuffle the order of the images and their labels")
    parser.add_argument("--backend", default="lmdb", choices=("lmdb", "leveldb"),
                        help="the database format (default lmdb)")
    parser.add_argument("--resize_width", type=int, default=0, help="resize images to this width (with --resize_height)")
    parser.add_argument("--resize_height", type=int, default=0, help="resize images to this height (with --resize_width)")
    _add_bool(parser, "check_size", "check that every datum has the same size")
    _add_bool(parser, "encoded", "store the encoded image (file bytes) in the datum")
    parser.add_argument("--encode_type", default="", help="re-encode images as this format (png, jpg, ...); "
                        "implies --encoded")
    parser.add_argument("root_folder", metavar="ROOTFOLDER/", help="prefixed to every path in LISTFILE")
    parser.add_argument("list_file", metavar="LISTFILE", help="lines of `path label`")
    parser.add_argument("db_name", metavar="DB_NAME", help="the database to create")
    return parser


def convert_imageset(argv):
    args = _parse(_convert_imageset_parser(), argv)
    if args is None:
        return 0
    if args.resize_width < 0 or args.resize_height < 0:
        raise ConfigError("convert_imageset: --resize_width and --resize_height must be >= 0")
    encoded = args.encoded or bool(args.encode_type)
    if args.encode_type and not args.encoded:
        log.info("convert_imageset: --encode_type given, assuming --encoded")
    from cct.data.transformer import read_image_list
    entries = read_image_list(args.list_file, "convert_imageset: LISTFILE")
    if args.shuffle:
        cct_rng.get_rng().shuffle(entries)
    is_color = not args.gray
    written = failed = 0
    data_size = None
    # Written aside and renamed into place: a killed run leaves no half-written database under
    # DB_NAME. An existing one is refused first, as open_db(DB_NAME, ..., "w") refuses it.
    if os.path.exists(args.db_name) and (not os.path.isdir(args.db_name) or os.listdir(args.db_name)):
        raise DataError(f"{args.db_name}: database already exists; remove it or choose another name")
    # A line each 1000 images in a log, as Caffe's "Processed 1000 files."
    with atomic_path(args.db_name) as temp_path, open_db(temp_path, args.backend, "w") as db, \
            Progress("convert_imageset", len(entries), "images", every=1000) as shown:
        for line_id, (name, label, number) in enumerate(shown.track(entries)):
            path = args.root_folder + name
            try:
                datum = _image_to_datum(path, label, args, is_color, encoded)
            except DataError as error:
                # Caffe skips images it cannot read and goes on.
                log.warning("convert_imageset: %s:%d: skipped: %s", args.list_file, number, error)
                failed += 1
                continue
            if args.check_size and not encoded:
                size = len(datum.data)
                if data_size is None:
                    data_size = size
                elif size != data_size:
                    raise DataError(f"convert_imageset: {path}: incorrect data field size {size}, "
                                    f"the first image has {data_size} (see --resize_width/--resize_height)")
            db.put(record_key(line_id, name), datum.SerializeToString())
            written += 1
    log.info("convert_imageset: wrote %d images to %s (%d skipped)", written, args.db_name, failed)
    if written == 0:
        raise DataError(f"convert_imageset: none of the {len(entries)} images in {args.list_file} "
                        f"could be read (is ROOTFOLDER {args.root_folder!r} right?)")
    return 0


def _image_to_datum(path, label, args, is_color, encoded):
    """Caffe's ReadImageToDatum: raw CHW pixels, or encoded bytes (the file's own
    when neither resizing nor another format is asked for, else re-encoded)."""
    image = read_image(path, args.resize_height, args.resize_width, is_color)
    if not encoded:
        return array_to_datum(image, label)
    encode_type = args.encode_type
    if not encode_type:
        # Guess the format from the file name, as Caffe does.
        encode_type = os.path.splitext(path)[1].lstrip(".").lower()
        if not encode_type:
            raise DataError(f"{path}: cannot guess the encoding from the file name; give --encode_type")
    unchanged = (image.shape[0] == 3) == is_color and not args.resize_height and not args.resize_width
    if unchanged and _matches_extension(path, encode_type):
        # As Caffe: the file's bytes, even a grey JPEG read as colour (it decodes the same way).
        with open(path, "rb") as handle:
            payload = handle.read()
    else:
        payload = encode_image(image, encode_type, path)
    return caffe_pb2.Datum(data=payload, label=int(label), encoded=True)


def _matches_extension(path, encode_type):
    """Caffe's matchExt: the file's extension is encode_type (.jpeg counts as jpg)."""
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    wanted = encode_type.lower()
    return ext == wanted or (wanted == "jpg" and ext == "jpeg")


# --- compute_image_mean ---------------------------------------------------------------
def _compute_image_mean_parser():
    parser = _Parser(prog="compute_image_mean", description="Compute the mean image of a database "
                     "of Datums, as Caffe's compute_image_mean.")
    parser.add_argument("--backend", default="lmdb", choices=("lmdb", "leveldb"),
                        help="the database format (default lmdb)")
    parser.add_argument("input_db", metavar="INPUT_DB", help="the database to read")
    parser.add_argument("output_file", metavar="OUTPUT_FILE", nargs="?", default=None,
                        help="the binaryproto to write (omit to only print the channel means)")
    return parser


def compute_image_mean(argv):
    args = _parse(_compute_image_mean_parser(), argv)
    if args is None:
        return 0
    mean = image_mean(args.input_db, args.backend)
    if args.output_file:
        save_mean_file(mean, args.output_file)
        log.info("compute_image_mean: wrote %s", args.output_file)
    for channel, value in enumerate(mean.reshape(mean.shape[0], -1).mean(axis=1)):
        log.info("compute_image_mean: mean value channel [%d]: %g", channel, value)
    return 0


def image_mean(path, backend="lmdb"):
    """The float32 (C, H, W) mean of every Datum in a database, as Caffe computes
    it: a float32 sum in database order divided by the count in float32."""
    total, count, shape = None, 0, None
    with open_db(path, backend) as db, Progress("compute_image_mean", _record_count(db), "images") as shown:
        for key, value in shown.track(db.items()):
            what = f"{path}: record '{bytes(key).decode(errors='replace')}'"
            try:
                datum = caffe_pb2.Datum.FromString(value)
            except Exception as error:
                raise DataError(f"{what}: not a serialized Datum: {error}") from None
            image = datum_to_array(datum, what)
            if total is None:
                shape, total = image.shape, np.zeros(image.shape, np.float32)
            elif image.shape != shape:
                raise DataError(f"{what}: incorrect data field size: image is {image.shape}, "
                                f"the first is {shape}")
            total += image
            count += 1
    if count == 0:
        raise DataError(f"{path}: database holds no records")
    return total / np.float32(count)


def _record_count(db):
    """The number of records when it is cheap to know (LMDB keeps it; LevelDB
    would read every key), else None."""
    return len(db) if isinstance(db, LMDB) else None
