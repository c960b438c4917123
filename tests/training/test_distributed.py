"""Data-parallel training over MPI (cct.training.distributed, issue 14).

Shards (no MPI needed): every data source read by N ranks of batch b gives,
at every iteration, the records one reader of batch N*b reads, so within an
epoch the ranks' records are disjoint and together cover the source. The
sums' buckets: small parameters gathered, large ones cut.

Under `mpirun` (marked mpi; tests/conftest.py skips them where mpirun or
mpi4py are missing, and fails them under CI=true): LeNet and
CaffeNet-mini trained for 20 iterations by 2 ranks of batch b and by 4 of
batch b/2 end with the weights of 1 rank of batch 2b fed the same images, to
1e-5 of each blob's largest value, for SGD, Nesterov and Adam, with and
without iter_size; to the same bits with the sums after backward, in buckets
of another size, and as sub-tasks of the streams schedule (where they start
while backward runs); of
the sums ready, each rank issues first the lowest layer's, in one order on
every rank; a request (SIGHUP) to one rank reaches all; a rank killed with
SIGKILL ends the job within 30 s naming it, and rank 0's last snapshot
loads and resumes on 2 ranks and on 1; a rank that fails ends every rank
with its error. As root, two
ranks on two hosts (network namespaces joined by a veth pair, MPI over TCP,
removed after) train as one process too."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cct
from cct.testing.gradient_check import make_layer
from cct.training import distributed
from helpers.data import raw_datum, start, write_hdf5_list, write_image_list, write_lmdb
from helpers.requirements import require, skip_or_fail

HERE = Path(__file__).resolve().parent
WORKER = HERE.parent / "helpers" / "mpi_worker.py"
LENET = HERE.parents[1] / "models" / "lenet" / "lenet_train_test.prototxt"
RECORDS = 128                    # LeNet's LMDB: 16 iterations of batch 8 before it wraps
ITERATIONS = 20
# Adam's delta: its step lr * m / (sqrt(v) + delta) turns a rounding error e in
# a gradient near 0 into up to lr * e / delta. At the default 1e-8 that is
# 1e6 e: a float32 sum taken in another order gives 3e-4 relative after 5
# steps, and so does one process of batch 8 run at 1 and at 2 batch partitions
# (measured); at 1e-4, 5.9e-6. 1e-3 (at most 10 e) keeps the comparison about
# the gradients.
UPDATES = {"SGD": "momentum: 0.9", "Nesterov": "momentum: 0.9",
           "Adam": "momentum: 0.9 momentum2: 0.999 delta: 1e-3"}


def mpirun(ranks, *argv):
    """The command line running argv on `ranks` ranks of this machine."""
    root = ["--allow-run-as-root"] if hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return ["mpirun", *root, "--oversubscribe", "-np", str(ranks), *map(str, argv)]


def environment():
    """The tests' environment without pytest-xdist's or an outer mpirun's
    variables, each rank on one core."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    return {**env, **ONE_WAY, "CCT_THREADS": "1"}


# Every run of a comparison sums in one way: layer after layer, convolutions
# on lowering type 1 (the chooser's pick may differ between processes).
ONE_WAY = {"CCT_SCHEDULE": "sequential", "CCT_LOWERING": "1"}


@pytest.fixture
def one_way(monkeypatch):
    """This process's nets as the ranks' (ONE_WAY); returns monkeypatch."""
    for name, value in ONE_WAY.items():
        monkeypatch.setenv(name, value)
    return monkeypatch


# --- shards -----------------------------------------------------------------------------
def lmdb_source(folder, count):
    datums = [raw_datum(np.full((1, 2, 2), index % 256, np.uint8), index) for index in range(count)]
    return (f'type: "Data" data_param {{ source: "{write_lmdb(folder / "db", datums)}" '
            'backend: LMDB batch_size: %d }')


def image_source(folder, count):
    pixels = [np.full((3, 2, 2), index % 256, np.uint8) for index in range(count)]
    root, listing = write_image_list(folder, pixels, list(range(count)))
    return (f'type: "ImageData" image_data_param {{ source: "{listing}" root_folder: "{root}" '
            'shuffle: true batch_size: %d }')


def hdf5_source(folder, count):
    ids = np.arange(count, dtype=np.float32)
    cut = count // 2
    listing = write_hdf5_list(folder, [{"x": ids[:cut, None], "label": ids[:cut]},
                                       {"x": ids[cut:, None], "label": ids[cut:]}])
    return f'type: "HDF5Data" hdf5_data_param {{ source: "{listing}" shuffle: true batch_size: %d }}'


SOURCES = {"Data": lmdb_source, "ImageData": image_source, "HDF5Data": hdf5_source}


def reader(source, batch, rank, size, seed=11):
    """A layer of the source at `batch`, set to shard `rank` of `size`; it
    returns the record ids (the labels) of each batch it reads."""
    layer = make_layer(f'name: "d" top: "x" top: "label" {source % batch}', cct.TRAIN)
    tops = start(layer)
    layer.set_shard(rank, size, seed)

    def read():
        layer.reshape([], tops)
        layer.forward([], tops)
        return tops[1].data.astype(int).tolist()
    return layer, read


@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("size", [2, 3])
def test_shards_read_what_one_reader_of_their_summed_batch_reads(kind, size, tmp_path):
    count, batch = 13, 2          # 13: the epochs do not end with an iteration
    source = SOURCES[kind](tmp_path, count)
    whole_layer, whole = reader(source, size * batch, 0, 1)
    shards = [reader(source, batch, rank, size) for rank in range(size)]
    for _ in range(3 * count // (size * batch) + 1):          # past two reshuffles
        expected = whole()
        parts = [read() for _, read in shards]
        assert sorted(sum(parts, [])) == sorted(expected)
        assert all(len(part) == batch for part in parts)
    for layer, _ in shards + [(whole_layer, None)]:
        getattr(layer, "close", lambda: None)()


@pytest.mark.parametrize("kind", SOURCES)
def test_shards_are_disjoint_and_cover_each_epoch(kind, tmp_path):
    size, batch = 2, 3
    count = 4 * size * batch      # an epoch is 4 iterations
    source = SOURCES[kind](tmp_path, count)
    shards = [reader(source, batch, rank, size) for rank in range(size)]
    for epoch in range(2):
        seen = [sum((read() for _ in range(4)), []) for _, read in shards]
        assert sorted(seen[0] + seen[1]) == list(range(count)), f"epoch {epoch}"
    for layer, _ in shards:
        getattr(layer, "close", lambda: None)()


def test_a_shard_outside_the_ranks_is_refused(tmp_path):
    layer = make_layer(f'name: "d" top: "x" top: "label" {lmdb_source(tmp_path, 3) % 1}', cct.TRAIN)
    start(layer)
    with pytest.raises(cct.core.errors.ConfigError, match=r"layer 'd' \(Data\): shard: rank 2 of 2"):
        layer.set_shard(2, 2, 0)
    layer.close()


def test_launchers_variables_say_how_many_ranks():
    assert distributed.launched_size({}) == 1
    assert distributed.launched_size({"OMPI_COMM_WORLD_SIZE": "4"}) == 4
    assert distributed.launched_size({"PMI_SIZE": "3"}) == 3
    with pytest.raises(cct.core.errors.ConfigError, match="OMPI_COMM_WORLD_SIZE='x'"):
        distributed.launched_size({"OMPI_COMM_WORLD_SIZE": "x"})


class Param:
    def __init__(self, size, dtype=np.float32):
        self.diff = np.zeros(size, dtype)


def test_buckets_gather_small_parameters_in_order_and_cut_large_ones():
    """CaffeNet's fc6 weights (151 MB) in pieces of at most the bucket; the
    small parameters, in backward's order, gathered until a bucket is full."""
    fc6, small = 4096 * 9216, [96, 256, 384, 4096, 1000]
    params = [Param(fc6)] + [Param(size) for size in small]
    order = [5, 0, 4, 3, 2, 1]
    units = distributed.plan_units(params, order, 2**20)
    pieces = [unit[0] for unit in units if unit[0][0] == 0]
    assert len(pieces) == -(-fc6 * 4 // 2**20) and all(end - begin <= 2**18 for _, begin, end in pieces)
    assert [(begin, end) for _, begin, end in pieces] == sorted((b, e) for _, b, e in pieces)
    assert pieces[0][1] == 0 and pieces[-1][2] == fc6
    assert [unit for unit in units if unit[0][0] != 0] == [[(5, 0, 1000), (4, 0, 4096), (3, 0, 384),
                                                             (2, 0, 256), (1, 0, 96)]]
    full_at_5000 = distributed.plan_units(params, order, 5000 * 4)[-2:]     # 1000 + 4096 fills one
    assert full_at_5000 == [[(5, 0, 1000), (4, 0, 4096)], [(3, 0, 384), (2, 0, 256), (1, 0, 96)]]
    assert distributed.plan_units(params, order, 0) == [[(index, 0, params[index].diff.size)] for index in order]


def test_the_bucket_size_is_read_from_the_environment():
    assert distributed.bucket_bytes({}) == distributed.BUCKET_BYTES
    assert distributed.bucket_bytes({"CCT_MPI_BUCKET": "64K"}) == 65536
    assert distributed.bucket_bytes({"CCT_MPI_BUCKET": "2m"}) == 2 * 2**20
    assert distributed.bucket_bytes({"CCT_MPI_BUCKET": "0"}) == 0
    with pytest.raises(cct.core.errors.ConfigError, match="environment variable CCT_MPI_BUCKET: must be a size in bytes"):
        distributed.bucket_bytes({"CCT_MPI_BUCKET": "big"})


# --- under mpirun -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lenet(tmp_path_factory):
    """LeNet (Caffe's, layer for layer) on an LMDB of 128 28x28 digits, at
    batch 2, 4 and 8: {batch: net path}, and the folder."""
    folder = tmp_path_factory.mktemp("lenet")
    digits = np.load(Path(cct.__file__).parent / "data" / "digits.npz")
    # upscaled 3x and jittered: without the jitter, flat regions tie in max
    # pooling, and rounding decides which input gets the gradient
    noise = np.random.default_rng(1).integers(0, 15, (RECORDS, 24, 24), dtype=np.uint8)
    upscaled = np.kron(digits["images"][:RECORDS], np.ones((3, 3), np.uint8)) * 15 + noise
    images = np.pad(upscaled, ((0, 0), (2, 2), (2, 2)))
    write_lmdb(folder / "db", [raw_datum(image[None], int(label))
                               for image, label in zip(images, digits["labels"][:RECORDS])])
    text = re.sub(r'source: "[^"]*"', f'source: "{folder / "db"}"', LENET.read_text())
    nets = {}
    for batch in (2, 4, 8):
        nets[batch] = folder / f"lenet{batch}.prototxt"
        nets[batch].write_text(text.replace("batch_size: 64", f"batch_size: {batch}"))
    return folder, nets


def write_solver(folder, net, name, kind="SGD", iter_size=1, max_iter=ITERATIONS, display=5, extra="",
                 base_lr=0.01):
    path = folder / f"{name}.prototxt"
    path.write_text(f'net: "{net}" type: "{kind}" {UPDATES[kind]} base_lr: {base_lr} lr_policy: "inv" '
                    f'gamma: 0.0001 power: 0.75 weight_decay: 0.0005 iter_size: {iter_size} '
                    f'max_iter: {max_iter} display: {display} random_seed: 7 snapshot_prefix: "{folder}/{name}" {extra}\n')
    return path


CASES = [(kind, iter_size) for kind in UPDATES for iter_size in (1, 2)]
CAFFENET_MINI = HERE.parent / "reference" / "cases" / "caffenet_mini_sgd" / "net.prototxt"


@pytest.fixture(scope="module")
def caffenet_mini(lenet):
    """The solver reference case's CaffeNet-mini (no dropout) reading an
    LMDB of 24 random 3x227x227 images of 20 classes, at batch 1, 2 and 4:
    {batch: net path}."""
    folder = lenet[0]
    rng = np.random.default_rng(3)
    write_lmdb(folder / "mini_db", [raw_datum(rng.integers(0, 256, (3, 227, 227)), int(rng.integers(20)))
                                    for _ in range(24)])
    text = CAFFENET_MINI.read_text()
    inputs = [line for line in text.splitlines() if '"Input"' in line]
    nets = {}
    for batch in (1, 2, 4):
        data = (f'layer {{ name: "data" type: "Data" top: "data" top: "label" transform_param {{ scale: 0.0039 }} '
                f'data_param {{ source: "{folder / "mini_db"}" backend: LMDB batch_size: {batch} }} }}')
        nets[batch] = folder / f"caffenet_mini{batch}.prototxt"
        nets[batch].write_text(text.replace(inputs[0], data).replace(inputs[1], ""))
    return nets


# CaffeNet-mini's learning rates: each blob moves by 1.2e-3 of its largest value
# or more in 20 iterations (its gaussian(0.02) weights pass conv1 small
# gradients). Faster, rounding grows faster: at 0.1 the ranks' reordered sums
# end up to 4.5e-5 of the largest value from one process's (conv1, conv5); at
# 0.03, up to 1.05e-5; at 0.02, up to 3.3e-6 (2 and 4 ranks, every case, measured).
MINI_RATES = {"SGD": 0.02, "Nesterov": 0.02, "Adam": 0.001}
NETS = {"lenet": 8, "mini": 4}            # each net's batch of one rank alone


def solvers_of_every_case(lenet, caffenet_mini, ranks):
    """{(net, kind, iter_size): a solver of the case at the batch of one of
    `ranks` ranks}."""
    folder, nets = lenet
    solvers = {}
    for kind, size in CASES:
        solvers["lenet", kind, size] = write_solver(folder, nets[NETS["lenet"] // ranks],
                                                    f"lenet_{kind}_{size}_r{ranks}", kind, size)
        solvers["mini", kind, size] = write_solver(folder, caffenet_mini[NETS["mini"] // ranks],
                                                   f"mini_{kind}_{size}_r{ranks}", kind, size,
                                                   base_lr=MINI_RATES[kind])
    return solvers


@pytest.fixture(scope="module")
def two_ranks(lenet, caffenet_mini):
    """Every case of both nets (and CLIPPED) trained once by 2 ranks in one
    mpirun, gradients summed while backward runs (CCT_MPI_OVERLAP=1; on one
    host the default is after it): {case: rank 0's weights}, and what
    pycaffe said on each rank."""
    folder, nets = lenet
    solvers = solvers_of_every_case(lenet, caffenet_mini, 2)
    solvers[CLIPPED] = write_solver(folder, nets[4], "clipped", "Nesterov", 2, extra="clip_gradients: 0.05")
    weights, said = train_on(2, folder / "two_ranks", list(solvers.values()), CCT_MPI_OVERLAP="1")
    return dict(zip(solvers, weights)), said


@pytest.fixture(scope="module")
def four_ranks(lenet, caffenet_mini):
    """Every case of both nets trained once by 4 ranks in one mpirun: {case: rank 0's weights}."""
    solvers = solvers_of_every_case(lenet, caffenet_mini, 4)
    weights, _ = train_on(4, lenet[0] / "four_ranks", list(solvers.values()))
    return dict(zip(solvers, weights))


CLIPPED = ("lenet", "Nesterov", "clipped")


def train_on(ranks, out, solvers, **env):
    """Rank 0's weights after each solver, and what pycaffe said on each rank."""
    out.mkdir()
    done = subprocess.run(mpirun(ranks, sys.executable, WORKER, out, *solvers), env={**environment(), **env},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    weights = [dict(np.load(out / f"{solver.name}.npz")) for solver in solvers]
    return weights, [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(ranks)]


def train_on_two(out, solvers, **env):
    return train_on(2, out, solvers, **env)


def trained_alone(one_way, folder, net, kind, iter_size, ranks=2, base_lr=0.01):
    """(initial, final) weights of one solver on `net` in this process, its
    batch in as many partitions as there were ranks: each image's forward
    then takes the GEMMs a rank's does, bit for bit, so where two inputs of
    a max pooling window tie to rounding, the same one wins (else the
    gradient goes elsewhere: one process alone at 1 and 2 partitions drifted
    4.5e-2 apart in 20 iterations). Only the gradients' sums differ."""
    one_way.setenv("CCT_PARTITIONS", str(ranks))
    solver = cct.get_solver(str(write_solver(folder, net, f"{net.stem}_{kind}_{iter_size}", kind, iter_size,
                                             base_lr=base_lr)))
    first = {f"{name}.{i}": blob.data.copy() for name, blobs in solver.net.params.items()
             for i, blob in enumerate(blobs)}
    solver.step(solver.param.max_iter)
    last = {f"{name}.{i}": blob.data.copy() for name, blobs in solver.net.params.items()
            for i, blob in enumerate(blobs)}
    solver.close()
    return first, last


@pytest.fixture(scope="module")
def alone(lenet, caffenet_mini):
    """(initial, final) weights of each case trained by one process at the
    ranks' summed batch, its batch in as many partitions as there were ranks
    (trained_alone); each made once, on first use."""
    made = {}
    nets = {"lenet": lenet[1][NETS["lenet"]], "mini": caffenet_mini[NETS["mini"]]}

    def weights(net, kind, iter_size, ranks):
        key = net, kind, iter_size, ranks
        if key not in made:
            with pytest.MonkeyPatch.context() as patch:
                for name, value in ONE_WAY.items():
                    patch.setenv(name, value)
                rate = MINI_RATES[kind] if net == "mini" else 0.01
                made[key] = trained_alone(patch, lenet[0], nets[net], kind, iter_size, ranks, rate)
        return made[key]
    return weights


EVERY_CASE = [(net, kind, size) for net in NETS for kind, size in CASES]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("net, kind, iter_size", EVERY_CASE, ids=[f"{n}-{k}-iter_size{s}" for n, k, s in EVERY_CASE])
def test_ranks_train_as_one_of_their_summed_batch(request, alone, net, kind, iter_size, ranks):
    """N ranks of batch b, 20 iterations: the weights of one of batch N*b."""
    trained = request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[ranks])
    got = trained[0] if ranks == 2 else trained
    first, expected = alone(net, kind, iter_size, ranks)
    assert_trained_alike(got[net, kind, iter_size], first, expected)


def assert_trained_alike(got, first, expected):
    """Each blob within 1e-5 of its largest value, which training moved far more."""
    assert set(got.keys()) == set(expected.keys())
    for name, values in expected.items():
        scale = np.abs(values).max()
        assert np.abs(got[name] - values).max() <= 1e-5 * scale, name
        assert np.abs(values - first[name]).max() > 1e-3 * scale, name


@pytest.mark.mpi
def test_sums_after_backward_give_the_numbers_of_sums_during_it(lenet, two_ranks):
    """CCT_MPI_OVERLAP=0 sums every gradient once backward has ended: the same
    sums, bitwise (with iter_size 2, and with clip_gradients, whose norm waits
    for every sum)."""
    folder, nets = lenet
    solvers = [folder / "lenet_SGD_2_r2.prototxt", folder / "clipped.prototxt"]
    weights, _ = train_on_two(folder / "after_backward", solvers, CCT_MPI_OVERLAP="0")
    for case, got in zip([("lenet", "SGD", 2), CLIPPED], weights):
        expected = two_ranks[0][case]
        assert all(got[name].tobytes() == expected[name].tobytes() for name in expected), case


@pytest.mark.mpi
def test_sums_on_the_streams_give_the_numbers_of_sums_beside_them(lenet, two_ranks):
    """In the streams schedule each sum is a sub-task on the communication
    stream (buckets of 64 KiB: LeNet's 1.6 MB would be one 2 MiB bucket,
    ready only at backward's end): the same sums as the overlap thread's,
    bitwise, and some start while backward still runs."""
    folder, _ = lenet
    cases = [("lenet", "SGD", 1), ("lenet", "Adam", 2), CLIPPED, ("mini", "Nesterov", 2)]
    names = {CLIPPED: "clipped"}
    solvers = [folder / f"{names.get(case, '_'.join(map(str, case)) + '_r2')}.prototxt" for case in cases]
    weights, said = train_on_two(folder / "on_streams", solvers, CCT_SCHEDULE="streams", CCT_MPI_BUCKET="64K")
    for case, got in zip(cases, weights):
        expected = two_ranks[0][case]
        assert all(got[name].tobytes() == expected[name].tobytes() for name in expected), case
    for early, iterations in said[0]["sums_during_backward"]:      # of the windows' last runs
        assert iterations > 0 and early >= iterations / 2


@pytest.fixture(scope="module")
def small_buckets(lenet, two_ranks):         # two_ranks writes the solvers
    """lenet_SGD_2_r2 and CLIPPED again by 2 ranks, sums during backward in buckets
    of 64 KiB (LeNet's ip1 weights, 1.6 MB, in 25 pieces; conv1, conv2's
    bias, ip1's bias and ip2 in one bucket), the communication thread
    held, once an iteration's first sum is ready, until backward has made
    every sum ready (mpi_worker.py), so it chooses among all: (weights,
    what each rank said)."""
    folder, _ = lenet
    solvers = [folder / "lenet_SGD_2_r2.prototxt", folder / "clipped.prototxt"]
    return train_on_two(folder / "small_buckets", solvers, CCT_MPI_OVERLAP="1", CCT_MPI_BUCKET="64K",
                        MPI_WORKER_HOLD="1")


@pytest.mark.mpi
def test_buckets_gather_small_parameters_and_cut_large_ones_to_the_same_numbers(two_ranks, small_buckets):
    weights, said = small_buckets
    units = said[0]["units"][0]
    params = [index for unit in units for index, _, _ in unit]
    assert max(len(unit) for unit in units) >= 4                         # a bucket of small parameters
    assert max(params.count(index) for index in set(params)) == 25       # ip1's weights, cut
    assert sorted(set(params)) == list(range(8))
    for index in set(params):                                           # the pieces tile each parameter
        pieces = sorted((begin, end) for unit in units for i, begin, end in unit if i == index)
        assert pieces[0][0] == 0 and all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    for case, got in zip([("lenet", "SGD", 2), CLIPPED], weights):
        expected = two_ranks[0][case]               # in buckets of the default size
        assert all(got[name].tobytes() == expected[name].tobytes() for name in expected), case


@pytest.mark.mpi
def test_sums_go_in_the_order_the_next_forward_needs_them_alike_on_every_rank(small_buckets):
    """Of the sums ready on every rank, the one holding the lowest layer goes
    first (parameter order is forward order: the lowest parameter, then the
    first piece); every rank issues the same sums in the same order."""
    _, said = small_buckets
    assert said[0]["traces"] == said[1]["traces"]
    for units, trace in zip(said[0]["units"], said[0]["traces"]):
        first = [min((index, begin) for index, begin, _ in unit) for unit in units]
        assert len(trace) == ITERATIONS * len(units)                     # every unit, every iteration
        for choice, ready in trace:
            assert choice == min(ready, key=first.__getitem__)
        starts = [k for k in range(len(trace)) if k % len(units) == 0]
        # held until backward ended: each iteration chooses from every sum, conv1's first
        assert all(len(trace[k][1]) == len(units) and first[trace[k][0]][0] == 0 for k in starts)


@pytest.mark.mpi
def test_pycaffe_reports_the_mpi_world(two_ranks):
    said = [{k: v for k, v in rank.items() if k in ("solver_count", "solver_rank")} for rank in two_ranks[1]]
    assert said == [{"solver_count": 2, "solver_rank": 0}, {"solver_count": 2, "solver_rank": 1}]


# --- two hosts: network namespaces joined by a veth pair, MPI over TCP ---------------------
AGENT = """#!/bin/sh
# OpenMPI's launch agent (in ssh's place) for this machine's two namespace "hosts"
host=$1; shift
case "$host" in
  %(a_ip)s) ns=%(a)s;; %(b_ip)s) ns=%(b)s;;
  *) echo "no host $host" >&2; exit 1;;
esac
exec ip netns exec $ns unshare --uts sh -c "hostname $ns; $*"
"""


def run_quiet(*command):
    return subprocess.run(command, capture_output=True, text=True)


@pytest.fixture
def two_hosts(tmp_path):
    """Two namespaces with private addresses on a veth pair, removed after:
    (the command prefix that runs mpirun on host A, mpirun's flags)."""
    require("two hosts")
    a, b = f"cct{os.getpid()}a", f"cct{os.getpid()}b"
    names = {"a": a, "b": b, "a_ip": "10.77.0.1", "b_ip": "10.77.0.2"}
    made = run_quiet("ip", "netns", "add", a)
    if made.returncode:
        skip_or_fail(f"cannot make network namespaces here: {made.stderr.strip()}")
    try:
        steps = [("netns", "add", b), ("link", "add", f"v{a}", "type", "veth", "peer", "name", f"v{b}")]
        for ns, ip in ((a, names["a_ip"]), (b, names["b_ip"])):
            steps += [("link", "set", f"v{ns}", "netns", ns), ("-n", ns, "addr", "add", f"{ip}/24", "dev", f"v{ns}"),
                      ("-n", ns, "link", "set", f"v{ns}", "up"), ("-n", ns, "link", "set", "lo", "up")]
        for step in steps:
            done = run_quiet("ip", *step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        agent = tmp_path / "agent.sh"
        agent.write_text(AGENT % names)
        agent.chmod(0o755)
        prefix = ["ip", "netns", "exec", a, "unshare", "--uts"]
        flags = ["--host", f"{names['a_ip']}:1,{names['b_ip']}:1", "--mca", "plm_rsh_agent", str(agent),
                 "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "10.77.0.0/24",
                 "--mca", "oob_tcp_if_include", "10.77.0.0/24"]
        yield prefix, flags
    finally:
        for ns in (a, b):
            run_quiet("ip", "netns", "delete", ns)


@pytest.mark.mpi
def test_two_hosts_over_tcp_train_as_one(lenet, two_hosts, tmp_path, one_way):
    """Ranks on two hosts sum during backward by default, to the same numbers."""
    folder, nets = lenet
    prefix, flags = two_hosts
    solver = write_solver(tmp_path, nets[4], "SGD_2_b4", "SGD", 2)
    command = mpirun(2, sys.executable, WORKER, tmp_path, solver)
    command[1:1] = flags
    done = subprocess.run(prefix + command, env=environment(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    said = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [rank["overlap"] for rank in said] == [[True], [True]]
    first, expected = trained_alone(one_way, tmp_path, nets[8], "SGD", 2)
    assert_trained_alike(dict(np.load(tmp_path / f"{solver.name}.npz")), first, expected)


def rank_pid(parent, rank):
    """The pid of MPI rank `rank` among the descendants of `parent`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            status = (entry / "status").read_text()
        except OSError:
            continue
        ppid = int(re.search(r"PPid:\s+(\d+)", status).group(1))
        if ppid == parent and f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def snapshots(folder, name):
    found = [int(m.group(1)) for p in folder.iterdir()
             if (m := re.fullmatch(re.escape(name) + r"_iter_(\d+)\.solverstate", p.name))]
    return sorted(found)


@pytest.mark.mpi
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
def test_a_killed_rank_ends_the_job_and_the_snapshot_resumes(lenet, tmp_path, one_way):
    """SIGHUP to rank 1 alone: rank 0 snapshots (the ranks agree on requests);
    then SIGKILL to rank 1."""
    folder, nets = lenet
    solver = write_solver(tmp_path, nets[4], "run", max_iter=100000, display=5)
    log_path = tmp_path / "train.log"
    with open(log_path, "w") as log_file:
        job = subprocess.Popen(mpirun(2, sys.executable, "-m", "cct.cli", "train", f"--solver={solver}"),
                               env=environment(), stdout=log_file, stderr=subprocess.STDOUT)
    try:
        wait_for(job, log_path, lambda: "Iteration 5 " in log_path.read_text())   # rank 1 handles signals
        os.kill(rank_pid(job.pid, 1), signal.SIGHUP)
        wait_for(job, log_path, lambda: snapshots(tmp_path, "run"))
        os.kill(rank_pid(job.pid, 1), signal.SIGKILL)
        killed = time.monotonic()
        job.wait(timeout=30)
        assert time.monotonic() - killed < 30
    finally:
        if job.poll() is None:
            job.kill()
    output = log_path.read_text()
    assert job.returncode != 0
    assert re.search(r"rank 1 .*(signal 9|Killed)", output), output[-3000:]
    assert "SIGHUP received: snapshot" not in output      # rank 1 logs warnings only
    state = tmp_path / f"run_iter_{snapshots(tmp_path, 'run')[-1]}.solverstate"
    resume_on_two_and_one(tmp_path, nets, state, one_way)


def wait_for(job, log_path, condition, seconds=60):
    deadline = time.monotonic() + seconds
    while not condition():
        assert job.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.05)


def resume_on_two_and_one(folder, nets, state, one_way):
    """The state resumes for 3 more iterations on 2 ranks of batch 4 and on 1
    of batch 8 (only rank 0 reads it: the iteration, history and weights
    reach rank 1 from there), to the same weights."""
    restored = cct.get_solver(str(write_solver(folder, nets[4], "probe")))
    restored.restore(str(state))
    stop = restored.iter + 3
    restored.close()
    two = write_solver(folder, nets[4], "two", max_iter=stop)
    done = subprocess.run(mpirun(2, sys.executable, "-m", "cct.cli", "train", f"--solver={two}",
                                 f"--snapshot={state}"), env=environment(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Restoring previous solver status from {state}" in done.stderr
    one_way.setenv("CCT_PARTITIONS", "2")        # as trained_alone
    one = cct.get_solver(str(write_solver(folder, nets[8], "one", max_iter=stop)))
    one.solve(str(state))
    expected = [blob.data.copy() for blob in one.net.learnable_params]
    one.close()
    net = cct.Net(str(nets[4]), cct.TEST, weights=str(folder / f"two_iter_{stop}.caffemodel"))
    got = [blob.data for blob in net.learnable_params]
    for ours, theirs in zip(got, expected):
        assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(theirs).max()
    net.close()


@pytest.mark.mpi
def test_a_failing_rank_ends_every_rank_with_its_error(lenet, tmp_path):
    """Rank 1's first record (the second of the database) is no Datum: its
    error, not a hang of rank 0 in the gradient sum."""
    folder, nets = lenet
    db = tmp_path / "db"
    write_lmdb(db, [raw_datum(np.zeros((1, 28, 28), np.uint8), 0), b"not a datum"] * 4)
    net = tmp_path / "net.prototxt"
    net.write_text(re.sub(r'source: "[^"]*"', f'source: "{db}"', nets[4].read_text()))
    solver = write_solver(tmp_path, net, "fails", max_iter=100)
    started = time.monotonic()
    done = subprocess.run(mpirun(2, sys.executable, "-m", "cct.cli", "train", f"--solver={solver}"),
                          env=environment(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert time.monotonic() - started < 30
    assert re.search(r"cct: error: MPI rank 1 of 2: .*record '00000001'.*not a serialized Datum",
                     done.stderr), done.stderr[-3000:]


@pytest.mark.mpi
def test_ranks_training_other_nets_are_refused_by_name(lenet, tmp_path):
    """mpirun's two programs (A : B): rank 1's net has batch 8, rank 0's 4."""
    folder, nets = lenet
    ours, theirs = write_solver(tmp_path, nets[4], "ours"), write_solver(tmp_path, nets[8], "theirs")
    train = [sys.executable, "-m", "cct.cli", "train"]
    command = mpirun(1, *train, f"--solver={ours}") + [":", "-np", "1", *train, f"--solver={theirs}"]
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert re.search(r"cct: error: MPI rank \d of 2: .*: MPI rank 1 trains with batch size 8, rank 0 with 4",
                     done.stderr), done.stderr[-3000:]


@pytest.mark.mpi
def test_only_rank_0_reads_the_weights(lenet, tmp_path, one_way):
    """Rank 1 is given a weights file that does not exist: it never opens it,
    and ends at rank 0's weights, trained from the file rank 0 read."""
    folder, nets = lenet
    start = tmp_path / "start.caffemodel"
    fresh = cct.Net(str(nets[4]), cct.TRAIN)            # its fillers drew other weights than the solver's
    fresh.save(str(start))
    fresh.close()
    solver = write_solver(tmp_path, nets[4], "tuned", max_iter=2, extra="snapshot_after_train: true")
    train = [sys.executable, "-m", "cct.cli", "train", f"--solver={solver}"]
    command = mpirun(1, *train, f"--weights={start}") + [":", "-np", "1", *train, f"--weights={tmp_path}/none"]
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"Loading weights from {start}" in done.stderr
    one_way.setenv("CCT_PARTITIONS", "2")                 # as trained_alone
    alone = cct.get_solver(str(write_solver(tmp_path, nets[8], "alone", max_iter=2)))
    alone.net.copy_from(str(start))
    alone.step(2)
    got = cct.Net(str(nets[4]), cct.TEST, weights=str(tmp_path / "tuned_iter_2.caffemodel"))
    for ours, theirs in zip(got.learnable_params, alone.net.learnable_params):
        assert np.abs(ours.data - theirs.data).max() <= 1e-5 * np.abs(theirs.data).max()
    got.close()
    alone.close()


@pytest.mark.mpi
@pytest.mark.opencl
@pytest.mark.parametrize("kind, iter_size", [("SGD", 1), ("Adam", 2)])
def test_ranks_on_the_device_train_as_one_reading_each_gradient_once(lenet, alone, kind, iter_size, tmp_path):
    """2 ranks of batch 4 on the OpenCL device (pocl in CI), 20 iterations:
    the weights of one process of batch 8 on the host; each rank's sums take
    each gradient off the device at most once an iteration (issue 37)."""
    require("opencl")
    folder, nets = lenet
    solver = write_solver(folder, nets[4], f"device_{kind}_{iter_size}", kind, iter_size)
    weights, said = train_on(2, tmp_path / "out", [solver], CCT_GPU="0")
    first, expected = alone("lenet", kind, iter_size, 2)
    assert_trained_alike(weights[0], first, expected)
    assert [rank["most_downloads_of_a_gradient"] for rank in said] == [1, 1]
