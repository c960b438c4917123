"""cct.runtime.settings: parsing and its errors, CCT_CONFIG and load(), the precedence of
lowering settings in a built Net, and partitions applied to the executor."""
import json

import numpy as np
import pytest

import cct
from cct.runtime import settings as config
from cct.core.errors import ConfigError
from cct.lowering import chooser
from cct.lowering.chooser import Machine
from cct.lowering.chunking import DEFAULT_BUDGET_MB

FIXED = Machine(bandwidth=21e9, gather_row=3e-9, scatter_row=3e-9, add_row=15e-9, gemm_flops=96e9,
                gemm_out_bandwidth=8e9, gemm_in_bandwidth=16e9)

NET = '''name: "configured"
layer { name: "data" type: "Input" top: "data" top: "label"
        input_param { shape { dim: 4 dim: 3 dim: 8 dim: 8 } shape { dim: 4 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        convolution_param { num_output: 6 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "conv2" type: "Convolution" bottom: "conv1" top: "conv2"
        convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "conv2" top: "ip"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
'''


@pytest.fixture(autouse=True)
def clean(tmp_path, monkeypatch):
    for name in ("CCT_CONFIG", "CCT_LOWERING", "CCT_LOWERING_BUDGET_MB", "CCT_PARTITIONS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))
    chooser.clear_memory_cache()
    monkeypatch.setattr(chooser, "measure_machine", lambda: FIXED)      # no timing in tests
    config.load(None)
    yield
    config.load(None)
    chooser.clear_memory_cache()


def write(tmp_path, contents, name="run.json"):
    path = tmp_path / name
    path.write_text(contents if isinstance(contents, str) else json.dumps(contents))
    return path


def types_of(net):
    return {layer.name: layer.lowering_type for layer in net.layers if layer.type == "Convolution"}


# --- parsing ---------------------------------------------------------------------------------
def test_parse_reads_layers_and_default():
    run = config.parse(json.dumps({"layers": {"conv1": {"lowering": 3, "partitions": 2}},
                                   "default": {"lowering": "auto", "measure": False}}), "run.json")
    assert run.layer_value("conv1", "lowering") == 3 and run.layer_value("conv1", "partitions") == 2
    assert run.layer_value("conv2", "lowering") is None
    assert run.value("conv2", "lowering") == "auto" and run.value("conv1", "measure") is False
    assert config.parse("{}").layers == {} and config.parse("{}").default == {}


@pytest.mark.parametrize("contents,where", [
    ({"layer": {}}, "layer: unknown key"),
    ({"layers": {"conv1": {"lowring": 1}}}, "layers.conv1.lowring: unknown key"),
    ({"layers": {"conv1": {"lowering": 4}}}, "layers.conv1.lowering: must be 1, 2, 3"),
    ({"layers": {"conv1": {"lowering": "3"}}}, "layers.conv1.lowering"),
    ({"layers": {"conv1": {"lowering": True}}}, "layers.conv1.lowering"),
    ({"layers": {"conv1": {"partitions": 0}}}, "layers.conv1.partitions: must be an integer >= 1"),
    ({"layers": {"conv1": {"threads": 0}}}, "layers.conv1.threads: must be an integer >= 1"),
    ({"default": {"threads": True}}, "default.threads: must be an integer >= 1"),
    ({"layers": {"conv1": {"partitions": 1.5}}}, "layers.conv1.partitions"),
    ({"layers": {"conv1": {"measure": "yes"}}}, "layers.conv1.measure: must be true or false"),
    ({"default": {"lowering_budget_mb": 0}}, "default.lowering_budget_mb: must be a number"),
    ({"default": {"colour": 1}}, "default.colour: unknown key"),
    ({"layers": {"conv1": 3}}, "layers.conv1: must be an object"),
    ({"layers": [1]}, "layers: must be an object"),
    ({"priorities": {"gamma": 1}}, "priorities.gamma: unknown key"),
    ({"priorities": {"alpha": -1}}, "priorities.alpha: must be a number >= 0"),
    ({"priorities": 0.5}, "priorities: must be an object"),
    ([1, 2], "must hold a JSON object"),
    ("{not json", "not valid JSON"),
])
def test_errors_name_the_file_and_key(tmp_path, contents, where):
    path = write(tmp_path, contents)
    with pytest.raises(ConfigError) as error:
        config.read(path)
    assert str(error.value).startswith(str(path)) and where in str(error.value)


def test_missing_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="nowhere.json: cannot read"):
        config.load(tmp_path / "nowhere.json")


def test_env_names_the_file_and_load_overrides_it(tmp_path, monkeypatch):
    from_env = write(tmp_path, {"default": {"lowering": 2}}, "env.json")
    monkeypatch.setenv("CCT_CONFIG", str(from_env))
    assert config.active().source == str(from_env)
    loaded = config.load(write(tmp_path, {"default": {"lowering": 3}}, "loaded.json"))
    assert config.active() is loaded
    config.load(None)
    assert config.active().source == str(from_env)
    monkeypatch.delenv("CCT_CONFIG")
    assert config.active() is None


# --- forcing lowering types in a built Net ------------------------------------------------------
def test_layer_setting_beats_default_beats_env(tmp_path, monkeypatch):
    config.load(write(tmp_path, {"layers": {"conv1": {"lowering": 3}}, "default": {"lowering": 2}}))
    assert types_of(cct.Net(NET, cct.TRAIN)) == {"conv1": 3, "conv2": 2}
    monkeypatch.setenv("CCT_LOWERING", "1")
    assert types_of(cct.Net(NET, cct.TRAIN)) == {"conv1": 3, "conv2": 2}
    config.load(write(tmp_path, {"layers": {"conv1": {"lowering": 3}}}))
    assert types_of(cct.Net(NET, cct.TRAIN)) == {"conv1": 3, "conv2": 1}


def test_auto_uses_the_chooser(tmp_path, monkeypatch):
    monkeypatch.setattr(chooser, "choose", lambda geom, batch, **kwargs: 2 if geom.channels == 3 else 3)
    config.load(write(tmp_path, {"default": {"lowering": "auto"}, "layers": {"conv2": {"lowering": 1}}}))
    assert types_of(cct.Net(NET, cct.TRAIN)) == {"conv1": 2, "conv2": 1}


def test_measure_and_budget_reach_the_layer(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(chooser, "choose", lambda geom, batch, **kwargs: seen.update(kwargs) or 1)
    config.load(write(tmp_path, {"layers": {"conv1": {"lowering_budget_mb": 0.5}}, "default": {"measure": True}}))
    net = cct.Net(NET, cct.TRAIN)
    assert seen["measure"] is True
    assert net.layer_dict["conv1"].lowering_budget == 2 ** 19
    assert net.layer_dict["conv2"].lowering_budget == DEFAULT_BUDGET_MB * 2 ** 20
    monkeypatch.setenv("CCT_LOWERING_BUDGET_MB", "8")
    net = cct.Net(NET, cct.TRAIN)
    assert net.layer_dict["conv1"].lowering_budget == 2 ** 19 and net.layer_dict["conv2"].lowering_budget == 8 * 2 ** 20


def test_forced_types_give_the_same_results(tmp_path):
    results = []
    for kind in (1, 2, 3):
        config.load(write(tmp_path, {"default": {"lowering": kind}}, f"type{kind}.json"))
        cct.set_random_seed(4)
        net = cct.Net(NET, cct.TRAIN)
        net.blobs["data"].data[...] = np.random.default_rng(0).standard_normal(net.blobs["data"].shape)
        net.blobs["label"].data[...] = [0, 1, 2, 1]
        net.forward()
        net.backward()
        assert set(types_of(net).values()) == {kind}
        results.append((net.blobs["conv2"].data.copy(), net.params["conv1"][0].diff.copy()))
    for data, diff in results[1:]:
        np.testing.assert_allclose(data, results[0][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(diff, results[0][1], rtol=1e-4, atol=1e-6)


# --- partitions ---------------------------------------------------------------------------------
def test_apply_sets_configured_partitions(tmp_path):
    run = config.load(write(tmp_path, {"layers": {"conv1": {"partitions": 2}, "relu1": {"partitions": 8},
                                                  "not_in_this_net": {"partitions": 2}}}))
    net = cct.Net(NET, cct.TRAIN)
    assert config.apply(net.executor) == {"conv1": 2, "relu1": 4}        # capped at the batch
    index = net.layer_names.index("conv1")
    assert net.executor.partitions(index) == 2 and net.executor.partitions(index + 1) == 4
    net.forward()
    net.backward()
    assert config.apply(net.executor, run) == {"conv1": 2, "relu1": 4}


def test_default_partitions_apply_where_allowed(tmp_path):
    config.load(write(tmp_path, {"default": {"partitions": 2}}))
    net = cct.Net(NET, cct.TRAIN)
    applied = config.apply(net.executor)
    assert applied == {"conv1": 2, "relu1": 2, "conv2": 2, "ip": 2}


@pytest.mark.parametrize("contents,message", [
    ({"layers": {"loss": {"partitions": 2}}}, "layers.loss.partitions: .*cannot be batch-partitioned"),
    ({"layers": {"ip": {"lowering": 2}}}, r"layers.ip.lowering: layer .ip. \(InnerProduct\) takes only partitions and threads"),
])
def test_apply_refuses_settings_that_do_not_fit(tmp_path, contents, message):
    config.load(write(tmp_path, contents))
    with pytest.raises(ConfigError, match=message):
        config.apply(cct.Net(NET, cct.TRAIN).executor)


def test_apply_without_a_config_does_nothing():
    assert config.apply(cct.Net(NET, cct.TRAIN).executor) == {}
