"""The fuzzing harness of tests/fuzz (issue 15): hypothesis strategies that
mutate valid inputs, and `attempt`, which runs one mutated input and tallies
how it ended. Every input must end as a CctError (a clean error) or run; any
other exception, or a run past HANG_SECONDS, fails the test.

The mutations are the ones a hostile or careless user makes: in text, numbers
set to 0, -1, 2.5, 1e9, 2^31, nan; enum values and quoted strings (layer
types, blob names, paths) swapped; lines dropped, doubled or swapped; in any
file, bytes set, inserted or cut off; in a protobuf message, any field set to
an extreme of its type, cleared, or a repeated field cut short or doubled; in
an HDF5 file, a dataset reshaped, retyped, renamed or removed.

The default test command runs DEFAULT_EXAMPLES inputs per kind, seeded
(derandomize: the same inputs on every run). The long run:

    CCT_FUZZ_EXAMPLES=10000 python -m pytest tests/fuzz -p no:xdist -q

prints, at the end, the inputs tried, clean errors, runs and uncaught
exceptions per input kind. CCT_FUZZ_KEEP_GOING=1 records an uncaught
exception and carries on (its type, place and first input are printed in
that table) instead of failing at the first one, to find many at once.
"""
import contextlib
import math
import os
import re
import signal
import threading
import traceback
from collections import Counter, defaultdict
from datetime import timedelta

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from cct.core.allocation import resident_bytes, set_memory_limit
from cct.core.errors import CctError
from cct.proto import caffe_pb2

EXAMPLES_ENV = "CCT_FUZZ_EXAMPLES"
KEEP_GOING_ENV = "CCT_FUZZ_KEEP_GOING"
DEFAULT_EXAMPLES = 100
# An input may take this much above what the process holds (cct's limit counts
# the whole process: cct.core.allocation): a mutated net that asks for more
# gets a clean MemoryLimitError instead of a long run through huge arrays.
MEMORY_HEADROOM = 64 << 20
HANG_SECONDS = 30

TALLY = defaultdict(Counter)                 # kind -> tried, clean, ran, foreign
FOREIGN = defaultdict(dict)                  # kind -> {(type, place): [count, first input]}


def fuzz_settings():
    """Seeded, with a deadline far above any input's time (ms), so only a
    near-hang trips it; the count from CCT_FUZZ_EXAMPLES for the long run."""
    # no explain phase: it writes patch files into the working tree
    return settings(max_examples=int(os.environ.get(EXAMPLES_ENV, DEFAULT_EXAMPLES)),
                    derandomize=True, database=None, deadline=timedelta(seconds=HANG_SECONDS / 2),
                    phases=(Phase.explicit, Phase.generate, Phase.shrink),
                    suppress_health_check=list(HealthCheck), print_blob=True)


class Hang(BaseException):
    """An input that ran past HANG_SECONDS (a BaseException: no `except
    Exception` in cct turns it into a clean error)."""


class WrappedForeign(Exception):
    """A CctError made from a foreign exception with no words of cct's own
    (a prefetch thread's failure, passed on by the data layer): still a bug."""


def attempt(kind, action, describe=lambda: ""):
    """Run action() under the memory limit and the hang alarm; tally the end."""
    tally = TALLY[kind]
    tally["tried"] += 1
    try:
        with _alarm(HANG_SECONDS), _memory_limit(resident_bytes() + MEMORY_HEADROOM):
            _unwrapped(action)
    except CctError:
        tally["clean"] += 1
        return
    except BaseException as error:                    # noqa: B036 (a Hang, a KeyboardInterrupt too)
        if isinstance(error, KeyboardInterrupt):
            raise
        tally["foreign"] += 1
        if not os.environ.get(KEEP_GOING_ENV):
            raise
        _record_foreign(kind, error, describe())
        return
    tally["ran"] += 1


def _unwrapped(action):
    """action(), a CctError that only passes a foreign exception on raised as one."""
    try:
        action()
    except CctError as error:
        cause = error.__cause__                  # ImportError: a Python layer's module, reported as it should be
        if cause is not None and not isinstance(cause, (CctError, ImportError)):
            raise WrappedForeign(str(error)) from cause
        raise


def _record_foreign(kind, error, described):
    error = error.__cause__ if isinstance(error, WrappedForeign) else error
    frame = traceback.extract_tb(error.__traceback__)[-1]
    key = (type(error).__name__, f"{os.path.basename(frame.filename)}:{frame.lineno}")
    entry = FOREIGN[kind].setdefault(key, [0, f"{error!r:.300}\n{described:.1500}"])
    entry[0] += 1


@contextlib.contextmanager
def _memory_limit(nbytes):
    previous = set_memory_limit(nbytes)
    try:
        yield
    finally:
        set_memory_limit(previous)


@contextlib.contextmanager
def _alarm(seconds):
    """Raise Hang in the main thread after `seconds` (a no-op on other threads)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ring(signum, frame):
        raise Hang(f"still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def report():
    """The tally as table lines, and the uncaught exceptions kept going past."""
    lines = [f"{'input kind':<16}{'tried':>8}{'clean':>8}{'ran':>8}{'uncaught':>10}"]
    for kind, tally in sorted(TALLY.items()):
        lines.append(f"{kind:<16}{tally['tried']:>8}{tally['clean']:>8}{tally['ran']:>8}{tally['foreign']:>10}")
    for kind, found in sorted(FOREIGN.items()):
        for (name, place), (count, first) in sorted(found.items()):
            lines.append(f"{kind}: {count} x {name} at {place}; first: {first}")
    return lines


# --- mutations of text --------------------------------------------------------------
INDEX = st.integers(0, 1 << 16)             # taken modulo the number of places: shrinks to the first

NUMBERS = ["0", "-1", "1", "2", "3", "7", "2.5", "-0.5", "1e9", "1000000000", "2147483647",
           "2147483648", "-2147483648", "4294967295", "18446744073709551615", "1e-30", "1e38",
           "nan", "inf", "-inf", "0x10", "00"]
# Every enum value caffe.proto knows, and the booleans: a swap is often valid.
WORDS = sorted({value.name for enum in caffe_pb2.DESCRIPTOR.enum_types_by_name.values() for value in enum.values}
               | {value.name for message in caffe_pb2.DESCRIPTOR.message_types_by_name.values()
                  for enum in message.enum_types for value in enum.values} | {"true", "false"})
STRINGS = ["", "data", "label", "loss", "nonexistent", "/nonexistent/file", "../x", "gaussian", "xavier",
           "msra", "bilinear", "uniform", "constant", "positive_unitball", "unknown", "SGD", "Adam",
           "step", "multistep", "poly", "sigmoid", "fixed", "inv", "exp", "\u00e9t\u00e9", "a b"]

_NUMBER = re.compile(r"(?<=:)\s*-?\.?[0-9][0-9a-fA-FxX.eE+-]*")
_WORD = re.compile(r"(?<=:)\s*[A-Za-z_][A-Za-z0-9_]*\b")
_STRING = re.compile(r'"[^"\n]*"')


def text_ops(strings=()):
    """A list of edits to prototxt-like text; `strings`: more quoted values to swap in."""
    choices = STRINGS + list(strings)
    return st.lists(st.one_of(
        st.tuples(st.just("number"), INDEX, st.sampled_from(NUMBERS)),
        st.tuples(st.just("word"), INDEX, st.sampled_from(WORDS)),
        st.tuples(st.just("string"), INDEX, st.sampled_from(choices)),
        st.tuples(st.just("string from text"), INDEX, INDEX),
        st.tuples(st.just("drop line"), INDEX),
        st.tuples(st.just("double line"), INDEX),
        st.tuples(st.just("swap lines"), INDEX, INDEX),
    ), max_size=4)


def byte_ops():
    """A list of byte-level edits: a byte set, bytes inserted, the end cut off."""
    return st.lists(st.one_of(
        st.tuples(st.just("set"), INDEX, st.integers(0, 255)),
        st.tuples(st.just("insert"), INDEX, st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("truncate"), INDEX),
    ), max_size=2)


def mutate_text(text, ops):
    for op in ops:
        text = _TEXT_EDITS[op[0]](text, *op[1:])
    return text


def _replace_match(pattern, text, where, value):
    matches = list(pattern.finditer(text))
    if not matches:
        return text
    match = matches[where % len(matches)]
    return text[:match.start()] + " " + value + text[match.end():]


def _swap_string(text, where, value):
    matches = list(_STRING.finditer(text))
    if not matches:
        return text
    match = matches[where % len(matches)]
    return text[:match.start()] + '"' + value + '"' + text[match.end():]


def _string_from_text(text, where, source):
    found = _STRING.findall(text)
    return _swap_string(text, where, found[source % len(found)][1:-1]) if found else text


def _line_edit(edit):
    def apply(text, *indices):
        lines = text.split("\n")
        picked = [index % len(lines) for index in indices]
        edit(lines, *picked)
        return "\n".join(lines)
    return apply


def _swap(lines, first, second):
    lines[first], lines[second] = lines[second], lines[first]


_TEXT_EDITS = {
    "number": lambda text, where, value: _replace_match(_NUMBER, text, where, value),
    "word": lambda text, where, value: _replace_match(_WORD, text, where, value),
    "string": _swap_string,
    "string from text": _string_from_text,
    "drop line": _line_edit(lambda lines, index: lines.pop(index)),
    "double line": _line_edit(lambda lines, index: lines.insert(index, lines[index])),
    "swap lines": _line_edit(_swap),
}


def mutate_bytes(data, ops):
    data = bytearray(data)
    for op in ops:
        where = op[1] % (len(data) + 1)
        if op[0] == "set" and data:
            data[where % len(data)] = op[2]
        elif op[0] == "insert":
            data[where:where] = op[2]
        elif op[0] == "truncate":
            del data[where:]
    return bytes(data)


# --- mutations of protobuf messages ---------------------------------------------------
_F = caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name["data"]          # any descriptor: for the type constants
_EXTREMES = {
    _F.CPPTYPE_INT32: [0, -1, 1, 2, 3, 1 << 30, 2**31 - 1, -2**31],
    _F.CPPTYPE_INT64: [0, -1, 1, 2, 1 << 40, 2**63 - 1, -2**63],
    _F.CPPTYPE_UINT32: [0, 1, 2, 3, 1 << 30, 2**32 - 1],
    _F.CPPTYPE_UINT64: [0, 1, 2, 1 << 40, 2**64 - 1],
    _F.CPPTYPE_FLOAT: [0.0, -1.0, 2.5, math.nan, math.inf, -math.inf, 1e30],
    _F.CPPTYPE_DOUBLE: [0.0, -1.0, 2.5, math.nan, math.inf, -math.inf, 1e300],
    _F.CPPTYPE_BOOL: [True, False],
    _F.CPPTYPE_STRING: ["", "x", "data", "/nonexistent", "\u00e9"],
}
_BYTES = [b"", b"\x00", b"\xff" * 7, b"garbage", b"\x89PNG\r\n\x1a\n"]


def message_ops():
    """Edits to a protobuf message: (edit, which field, which value)."""
    return st.lists(st.tuples(st.sampled_from(["set", "clear", "drop", "double", "halve"]), INDEX, INDEX),
                    max_size=4)


def mutate_message(message, ops):
    """Apply `ops` to `message` in place; returns it."""
    for edit, where, pick in ops:
        slots = _set_fields(message, [])
        if slots:
            parent, field = slots[where % len(slots)]
            with contextlib.suppress(ValueError, TypeError):       # an edit protobuf refuses: skipped
                _MESSAGE_EDITS[edit](parent, field, pick)
    return message


def _set_fields(message, slots):
    """(message, field) for every field set, in every nested message."""
    for field, value in message.ListFields():
        slots.append((message, field))
        if field.cpp_type == field.CPPTYPE_MESSAGE:
            for sub in (value if _repeated(field) else [value]):
                _set_fields(sub, slots)
    return slots


def _repeated(field):
    return field.is_repeated


def _value(field, pick):
    if field.cpp_type == field.CPPTYPE_ENUM:
        values = [value.number for value in field.enum_type.values]
    elif field.type == field.TYPE_BYTES:
        values = _BYTES
    else:
        values = _EXTREMES[field.cpp_type]
    return values[pick % len(values)]


def _set(parent, field, pick):
    if field.cpp_type == field.CPPTYPE_MESSAGE:
        target = getattr(parent, field.name)
        (target[pick % len(target)] if _repeated(field) else target).Clear()
    elif _repeated(field):
        values = getattr(parent, field.name)
        values[pick % len(values)] = _value(field, pick // len(values))
    else:
        setattr(parent, field.name, _value(field, pick))


def _drop(parent, field, pick):
    if _repeated(field):
        values = getattr(parent, field.name)
        del values[pick % len(values)]
    else:
        parent.ClearField(field.name)


def _double(parent, field, pick):
    if not _repeated(field):
        return
    values = getattr(parent, field.name)
    item = values[pick % len(values)]
    if field.cpp_type == field.CPPTYPE_MESSAGE:
        values.add().CopyFrom(item)
    else:
        values.append(item)


def _halve(parent, field, pick):
    if _repeated(field):
        values = getattr(parent, field.name)
        del values[len(values) // 2:]


_MESSAGE_EDITS = {"set": _set, "clear": lambda parent, field, pick: parent.ClearField(field.name),
                  "drop": _drop, "double": _double, "halve": _halve}


def mutated_message_bytes(message, ops, raw_ops):
    """A copy of `message` with `ops` applied, serialized, then `raw_ops` on the bytes."""
    copy = type(message)()
    copy.CopyFrom(message)
    return mutate_bytes(mutate_message(copy, ops).SerializeToString(), raw_ops)


# --- mutations of HDF5 files ----------------------------------------------------------
SHAPES = [(), (0,), (1,), (2,), (3, 5), (2, 1, 3, 3), (1 << 30,), (2, 1 << 31)]
DTYPES = ["float32", "float64", "int32", "uint8", "bool", "S5"]


def hdf5_ops():
    """Edits to an HDF5 file: (edit, which object, which value)."""
    return st.lists(st.tuples(st.sampled_from(["reshape", "retype", "rename", "delete", "group"]), INDEX, INDEX),
                    max_size=3)


def mutate_hdf5(path, ops):
    """Apply `ops` to the HDF5 file at `path`, in place."""
    import h5py
    with h5py.File(path, "r+") as handle:
        for edit, where, pick in ops:
            names = []
            handle.visit(names.append)
            if names:
                with contextlib.suppress(ValueError, KeyError, TypeError, OSError):   # refused by HDF5: skipped
                    _HDF5_EDITS[edit](handle, names[where % len(names)], pick)


def _reshape(handle, name, pick):
    """A dataset of another shape, never written: HDF5 stores nothing for it
    (the fill value), so a declared 2^31 floats costs no disk."""
    del handle[name]
    handle.create_dataset(name, shape=SHAPES[pick % len(SHAPES)], dtype="float32")


def _retype(handle, name, pick):
    item = handle[name]
    if not hasattr(item, "shape") or item.size > 1 << 16:     # never read a reshaped huge one
        return
    values = item[()]
    del handle[name]
    dtype = DTYPES[pick % len(DTYPES)]
    handle.create_dataset(name, data=values.astype(dtype) if hasattr(values, "astype") else values)


def _rename(handle, name, pick):
    handle.move(name, name.rpartition("/")[0] + "/" + ["x", "-1", "99", "data", "label", "0"][pick % 6])


def _to_group(handle, name, pick):
    del handle[name]
    handle.create_group(name)


_HDF5_EDITS = {"reshape": _reshape, "retype": _retype, "rename": _rename,
               "delete": lambda handle, name, pick: handle.__delitem__(name), "group": _to_group}
