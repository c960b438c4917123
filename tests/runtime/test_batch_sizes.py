"""One partition plan fits every batch size: a layer runs at most one batch
partition per sample of the batch it has at each forward, so a plan asked
for at one batch runs at a smaller one (a deploy net reshaped to one image, a
test net smaller than its train net) with fewer partitions, to the same
numbers. The deploy nets of models/ with seeded weights give every forward
blob of a sample the same values, to 1e-5 of the blob's largest, whether the
sample runs alone, in a batch of 3 or in a batch of 8, under every plan."""
import json

import numpy as np
import pytest
from google.protobuf import text_format

import cct
from cct.proto import caffe_pb2
from cct.runtime import settings, threads
from cct.training import solver as solver_module
from helpers.paths import MODELS

LENET = MODELS / "lenet" / "lenet.prototxt"
CAFFENET = MODELS / "bvlc_reference_caffenet" / "deploy.prototxt"
GOOGLENET = MODELS / "bvlc_googlenet" / "deploy.prototxt"
BATCH = 8
# The samples' runs besides the batch of 8: three batches of 3 (the last
# overlapping, so every batch is full), then each sample alone.
RUNS = [(0, 3), (3, 6), (5, 8)] + [(i, i + 1) for i in range(BATCH)]
PLANS = ["default", 2, 3, 8]


@pytest.fixture(autouse=True)
def no_run_settings(monkeypatch):
    for name in ("CCT_CONFIG", "CCT_PARTITIONS", "CCT_LOWERING", "CCT_THREADS"):
        monkeypatch.delenv(name, raising=False)
    settings.load(None)
    yield
    settings.load(None)


def use_plan(plan, monkeypatch):
    """The default plan splits only with 2 threads or more (BLAS stays at the
    one thread per test worker of conftest: two busy-waiting BLAS threads
    beside the other worker stall); a count is asked for every layer by a run
    configuration, as a user would."""
    if plan == "default":
        monkeypatch.setenv("CCT_THREADS", "2")
        monkeypatch.setattr(threads.blas(), "set", lambda count: None)
    else:
        settings.load(settings.parse(json.dumps({"default": {"partitions": plan}}), "run.json"))


def seed_weights(net, seed=0):
    """Uniform weights of variance 2 / fan-in (a deploy net's are all zero),
    so activations keep their scale through the deep nets."""
    rng = np.random.default_rng(seed)
    for blobs in net.params.values():
        for blob in blobs:
            fan_in = blob.count // blob.shape[0] if len(blob.shape) > 1 else 10
            limit = np.float32(np.sqrt(6.0 / fan_in))
            blob.data[...] = (2 * rng.random(blob.shape, dtype=np.float32) - 1) * limit


def forward_blobs(net, images):
    """Every blob's data after a forward of `images` (pycaffe's reshape-then-forward)."""
    net.blobs["data"].reshape(*images.shape)
    net.blobs["data"].data[...] = images
    net.forward()
    return {name: blob.data.copy() for name, blob in net.blobs.items()}


def assert_plan_fits(net, asked):
    """No layer runs more partitions than its batch has samples; a configured
    count runs in full where the batch allows it."""
    executor = net.executor
    for index in range(len(net.layers)):
        batch = executor.batch(index)
        used = executor.partitions(index)
        assert used == 1 or used <= batch, net.layers[index].name
        if asked != "default" and executor.partitionable(index):
            assert used == min(asked, batch), net.layers[index].name


def assert_batch_invariant(path, plan, monkeypatch, runs=RUNS):
    """Returns the most partitions a layer ran at the batch of 8."""
    use_plan(plan, monkeypatch)
    net = cct.Net(str(path), cct.TEST)
    seed_weights(net)
    shape = net.blobs["data"].shape
    images = np.random.default_rng(1).random((BATCH,) + tuple(shape[1:]), dtype=np.float32)
    whole = forward_blobs(net, images)
    assert_plan_fits(net, plan)
    most = max(net.executor.partitions(i) for i in range(len(net.layers)))
    for start, stop in runs:
        part = forward_blobs(net, images[start:stop])
        assert_plan_fits(net, plan)
        for name, values in whole.items():
            largest = float(np.abs(values).max())
            error = float(np.abs(part[name] - values[start:stop]).max())
            assert error <= 1e-5 * largest, f"{name}, samples {start}..{stop - 1}: {error:.3g} of {largest:.3g}"
    return most


@pytest.mark.parametrize("lowering", ["auto", "1", "2", "3"])
@pytest.mark.parametrize("plan", PLANS)
def test_lenet_is_batch_invariant_under_every_plan_and_lowering(plan, lowering, monkeypatch):
    if lowering != "auto":
        monkeypatch.setenv("CCT_LOWERING", lowering)
    assert_batch_invariant(LENET, plan, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
def test_caffenet_is_batch_invariant_under_every_plan(plan, monkeypatch):
    # (the default plan splits the layers of a million outputs or more in 2, one per thread)
    assert assert_batch_invariant(CAFFENET, plan, monkeypatch) == (2 if plan == "default" else plan)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
def test_googlenet_is_batch_invariant_under_every_plan(plan, monkeypatch):
    assert assert_batch_invariant(GOOGLENET, plan, monkeypatch) == (2 if plan == "default" else plan)


# --- the crash of issue 18 ---------------------------------------------------------------------
def test_a_deploy_net_reshaped_below_its_partitions_runs(tmp_path):
    """Was: ValueError: cannot reshape array of size 0 into shape (1,newaxis,0)
    from lowering/type1.py, the batch of 1 split into an empty partition."""
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"default": {"partitions": 2}}))
    image = np.random.default_rng(2).random((1, 1, 28, 28), dtype=np.float32)
    probabilities = []
    for path in (config, None):
        settings.load(path)
        net = cct.Net(str(LENET), cct.TEST)          # built at batch 64: conv1 gets 2 partitions
        seed_weights(net)
        assert net.executor.partitions(net.layer_names.index("conv1")) == (2 if path else 1)
        probabilities.append(forward_blobs(net, image)["prob"])
        assert all(net.executor.partitions(i) == 1 for i in range(len(net.layers)))
    np.testing.assert_allclose(probabilities[0], probabilities[1], rtol=1e-6, atol=1e-7)


# --- training ----------------------------------------------------------------------------------------
def lenet_train_test(train_batch, test_batch):
    """LeNet's train/test net with DummyData (gaussian images, label 0) in
    place of its LMDBs, one data layer per phase."""
    net_param = text_format.Parse((MODELS / "lenet" / "lenet_train_test.prototxt").read_text(),
                                  caffe_pb2.NetParameter())
    for layer in net_param.layer:
        if layer.type == "Data":
            batch = train_batch if layer.include[0].phase == caffe_pb2.TRAIN else test_batch
            layer.type = "DummyData"
            layer.ClearField("data_param")
            layer.ClearField("transform_param")
            dummy = layer.dummy_data_param
            dummy.shape.add(dim=[batch, 1, 28, 28])
            dummy.shape.add(dim=[batch])
            dummy.data_filler.add(type="gaussian", std=1.0)
            dummy.data_filler.add(type="constant", value=0)
    return net_param


def lenet_solver(train_batch, test_batch, config):
    settings.load(config)
    cct.set_random_seed(5)
    param = text_format.Parse('base_lr: 0.01 momentum: 0.9 weight_decay: 0.0005 lr_policy: "fixed" '
                              'test_iter: 2 test_interval: 1 test_initialization: false random_seed: 5',
                              caffe_pb2.SolverParameter())
    param.net_param.CopyFrom(lenet_train_test(train_batch, test_batch))
    return solver_module.get_solver(param)


def test_a_training_step_at_batch_1_with_4_partitions_equals_the_whole_one(tmp_path):
    params = []
    for partitions in (4, 1):
        config = tmp_path / f"run{partitions}.json"
        config.write_text(json.dumps({"default": {"partitions": partitions}}))
        solver = lenet_solver(1, 1, config)
        conv1 = solver.net.layer_names.index("conv1")
        assert solver.net.executor.plan[conv1] == partitions and solver.net.executor.partitions(conv1) == 1
        solver.step(1)
        params.append({name: [blob.data.copy() for blob in blobs] for name, blobs in solver.net.params.items()})
    for name, blobs in params[1].items():
        for ours, theirs in zip(params[0][name], blobs):
            np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=0, err_msg=name)


def test_a_train_and_test_net_share_a_configuration_their_test_batch_cannot_fill(tmp_path, monkeypatch):
    """The test net's batch (1) is smaller than the partitions the shared file
    asks, for one layer by name and for every layer by default: the test net
    runs whole, the train net as asked, and the scores are the unconfigured run's."""
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"layers": {"conv1": {"partitions": 4}}, "default": {"partitions": 3}}))
    scores = []
    for path in (config, None):
        solver = lenet_solver(6, 1, path)
        solver.step(2)
        scores.append(solver.mean_scores[0])
        if path is not None:
            train, test = solver.net, solver.test_nets[0]
            conv1 = train.layer_names.index("conv1")
            assert train.executor.partitions(conv1) == 4
            assert train.executor.partitions(train.layer_names.index("pool1")) == 3
            assert all(test.executor.partitions(i) == 1 for i in range(len(test.layers)))
    np.testing.assert_allclose(scores[0], scores[1], rtol=1e-5)


# --- empty batches and empty axes (issue 15) -------------------------------------------
ZERO_NET = """force_backward: true
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: %d dim: %d dim: 9 dim: 9 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip" type: "InnerProduct" bottom: "pool" top: "ip" inner_product_param { num_output: 3 } }
"""


@pytest.mark.parametrize("lowering", ["1", "2", "3"])
@pytest.mark.parametrize("plan", PLANS)
def test_an_empty_batch_runs_under_every_plan(plan, lowering, monkeypatch):
    """A batch of 0 (Caffe runs it): every partition count and lowering type,
    forward and backward, tops of 0 samples."""
    use_plan(plan, monkeypatch)
    monkeypatch.setenv("CCT_LOWERING", lowering)
    net = cct.Net(ZERO_NET % (0, 3), cct.TEST)
    net.forward()
    net.backward()
    assert net.blobs["ip"].shape == (0, 3) and net.blobs["data"].diff.shape == (0, 3, 9, 9)


@pytest.mark.parametrize("lowering", ["1", "2", "3"])
@pytest.mark.parametrize("plan", PLANS)
def test_no_input_channels_is_a_clean_error_not_a_division_by_zero(plan, lowering, monkeypatch):
    """Found by the fuzzer: 0 channels divided by zero in the lowering's chunk
    sizes (ZeroDivisionError) and failed to reshape its matrices (ValueError)."""
    use_plan(plan, monkeypatch)
    monkeypatch.setenv("CCT_LOWERING", lowering)
    with pytest.raises(cct.ShapeError, match=r"layer 'conv' \(Convolution\): bottom 'data' \(4, 0, 9, 9\) "
                                             "has no channels"):
        cct.Net(ZERO_NET % (4, 0), cct.TEST).forward()


@pytest.mark.parametrize("plan", PLANS)
def test_an_empty_spatial_axis_is_a_clean_error(plan, monkeypatch):
    use_plan(plan, monkeypatch)
    with pytest.raises(cct.ShapeError, match=r"layer 'conv' \(Convolution\): input 0 x 9 does not fit the kernel"):
        cct.Net((ZERO_NET % (4, 3)).replace("dim: 9 dim: 9", "dim: 0 dim: 9"), cct.TEST)
