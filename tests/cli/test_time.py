"""`cct time` (cct.cli.time): Caffe's per-layer and average lines, the phase
flag, and the profile table it prints after them (FLOP rates, lowering,
partitions; --tune's chosen partitions)."""
import json
import re

import pytest

from helpers.cli import assert_one_line_error, messages, run_cct
from helpers.linreg import net_text
from helpers.nets import PROFILE_NET, PROFILE_NET_LAYERS


@pytest.mark.slow
def test_time_output_format(run_folder, capsys):
    code, _, err = run_cct(capsys, "time", "-model", "net.prototxt", "-iterations", "3")
    assert code == 0, err
    text = messages(err)
    for name in ("data", "fc"):
        assert any(re.fullmatch(rf" *{name}\tforward: [0-9.e+-]+ ms\.", m) for m in text), text
        assert any(re.fullmatch(rf" *{name}\tbackward: [0-9.e+-]+ ms\.", m) for m in text), text
    assert [m for m in text if m.startswith("      data\t")]              # names right-aligned in 10
    for label in ("Average Forward pass", "Average Backward pass", "Average Forward-Backward", "Total Time"):
        assert any(re.fullmatch(rf"{label}: [0-9.e+-]+ ms\.", m) for m in text), label
    assert sum(m.startswith("Iteration: ") and "forward-backward time" in m for m in text) == 3
    assert text.index("*** Benchmark begins ***") < text.index("*** Benchmark ends ***")
    pool_line = next(m for m in text if m.startswith("One pool: "))     # cct time builds in TRAIN
    assert "not lent to a TRAIN-phase net" in pool_line or pool_line.startswith(("One pool: none", "One pool: off"))


@pytest.mark.slow
def test_time_and_test_phase_flag(run_folder, capsys):
    (run_folder / "net.prototxt").write_text(net_text() + """
layer { name: "only_test" type: "TestLinReg" bottom: "x" bottom: "t" top: "loss2"
        include { phase: TEST } inner_product_param { num_output: 2 } }
""")
    def timed_layers(*flags):
        code, _, err = run_cct(capsys, "time", "-model", "net.prototxt", "-iterations", "1", *flags)
        assert code == 0, err
        return [m.split("\t")[0].strip() for m in messages(err) if "\tforward:" in m]
    assert timed_layers() == ["data", "fc"]                     # caffe time builds in TRAIN
    tested = timed_layers("-phase", "TEST")                      # Split layers join in, shared x and t
    assert tested[0] == "data" and tested[-2:] == ["fc", "only_test"]


@pytest.mark.slow
def test_time_prints_caffes_per_layer_lines(run_folder, capsys):
    code, _, err = run_cct(capsys, "time", "--model=net.prototxt", "--iterations=1")
    assert code == 0
    assert any(re.fullmatch(r" +fc\tforward: \S+ ms\.", m) for m in messages(err))
    assert any(re.fullmatch(r" +fc\tbackward: \S+ ms\.", m) for m in messages(err))


@pytest.mark.opencl
def test_time_on_an_opencl_device_says_where_each_layer_ran(tmp_path, capsys, monkeypatch):
    from helpers.devices import opencl_or_skip
    device = opencl_or_skip()
    path = tmp_path / "tiny.prototxt"
    path.write_text(PROFILE_NET)
    code, _, err = run_cct(capsys, "time", "--model", path, "--iterations", "2", "--peak_size", "64", "--gpu", "0")
    assert code == 0, err
    text = messages(err)
    assert "GEMM peak: " in "\n".join(text) and f"on OpenCL device {device.name}" in "\n".join(text)
    on_device = next(m for m in text if m.startswith(f"Ran on {device.name}: "))
    assert "conv (Convolution)" in on_device and "fc (InnerProduct)" in on_device
    # an Input net's blobs and weights stay on the device once there: down, its loss's few bytes (issue 37)
    assert any(m.startswith(f"Device traffic per iteration on {device.name}: up 0.000 MB in 0 copies, "
                            "down 0.000 MB in ") for m in text)


# --- the profile table -----------------------------------------------------------------------------
def test_time_prints_the_profile_table(tmp_path, capsys):
    path = tmp_path / "tiny.prototxt"
    path.write_text(PROFILE_NET)
    code, _, err = run_cct(capsys, "time", "--model", path, "--iterations", "2", "--peak_size", "64")
    assert code == 0, err
    text = messages(err)
    # Caffe's own lines are untouched.
    assert any(re.fullmatch(r" +conv\tforward: [0-9.e+-]+ ms\.", m) for m in text)
    assert any(re.fullmatch(r"GEMM peak: [0-9.]+ GFLOP/s \(sgemm 64, \d+ BLAS threads\)", m) for m in text)
    start = next(i for i, m in enumerate(text) if m.startswith("Profile per layer (GEMM peak"))
    header = text[start + 1].split()
    assert header[:4] == ["layer", "type", "fwd", "ms"] and header[-2:] == ["lowering", "partitions"]
    rows = {m.split()[0]: m.split() for m in text[start + 2:start + 2 + len(PROFILE_NET_LAYERS)]}
    assert list(rows) == PROFILE_NET_LAYERS
    for name in ("conv", "pool", "norm", "deconv", "fc"):
        layer_type, fwd_ms, bwd_ms, fwd_rate, bwd_rate, share, limit, over, lowering, partitions = rows[name][1:]
        assert float(fwd_ms) >= 0 and float(bwd_ms) >= 0
        assert fwd_rate == "-" or float(fwd_rate) >= 0
        assert share == "-" or float(share) >= 0
        assert float(limit) > 0 and float(over) >= 0
        assert partitions == "1"
    assert rows["conv"][9] in ("1", "2", "3") and rows["deconv"][9] in ("1", "2", "3")
    # ReLU does no GEMM work but has a limit: its bytes at the memory bandwidth
    assert rows["relu"][4:7] == ["-", "-", "-"] and float(rows["relu"][7]) > 0 and rows["relu"][9] == "-"
    assert any(re.fullmatch(r"Net: [0-9.e+-]+ GFLOP per forward-backward, [0-9.]+ GFLOP/s = \d+% of "
                            r"the GEMM peak", m) for m in text)
    assert any(re.fullmatch(r"Memory bandwidth: [0-9.]+ GB/s \(copies of 64 MB, \d+ threads\)", m) for m in text)
    assert any(re.fullmatch(r"Limits \(memory bandwidth [0-9.]+ GB/s\): the net takes [0-9.]+ ms against "
                            r"[0-9.]+ ms, [0-9.]+x", m) for m in text)
    worst = next(m for m in text if m.startswith("Most time over the limit: "))
    assert len(worst.split("), ")) == 5 and all(n in PROFILE_NET_LAYERS for n in re.findall(r"(\w+) (?:for|back)ward", worst))


def test_time_tune_shows_the_chosen_partitions(tmp_path, capsys):
    path = tmp_path / "tiny.prototxt"
    path.write_text(PROFILE_NET)
    code, _, err = run_cct(capsys, "time", "--model", path, "--iterations", "1", "--peak_size", "0", "--tune")
    assert code == 0, err
    text = messages(err)
    plan_line = next(m for m in text if m.startswith("Partitions: "))
    plan = dict(item.split("=") for item in plan_line[len("Partitions: "):].split(", "))
    assert "conv" in plan and "fc" in plan
    start = next(i for i, m in enumerate(text) if m == "Profile per layer:")
    rows = {m.split()[0]: m.split() for m in text[start + 2:start + 2 + len(PROFILE_NET_LAYERS)]}
    for name, partitions in plan.items():
        assert rows[name][-1] == partitions
    assert not any("GEMM peak" in m for m in text)


def test_time_refuses_a_negative_peak_size(tmp_path, capsys):
    path = tmp_path / "tiny.prototxt"
    path.write_text(PROFILE_NET)
    code, _, err = run_cct(capsys, "time", "--model", path, "--peak_size", "-1")
    assert_one_line_error(code, err, "--peak_size: must be >= 0, got -1")


def time_streamed(capsys, tmp_path, schedule):
    """`cct time` of the profile net in `schedule` with a JSON trace: its log
    messages and the trace's events."""
    from cct.runtime import settings
    path = tmp_path / "tiny.prototxt"
    path.write_text(PROFILE_NET)
    trace = tmp_path / "trace.json"
    try:
        code, _, err = run_cct(capsys, "time", "--model", path, "--iterations", "1", "--peak_size", "0",
                               "--schedule", schedule, "--trace", trace)
    finally:
        settings.set_schedule(None)
    assert code == 0, err
    return messages(err), json.loads(trace.read_text())["traceEvents"]


def test_time_streams_prints_the_sub_tasks_and_writes_a_trace(tmp_path, capsys):
    text, events = time_streamed(capsys, tmp_path, "streams")
    start = next(i for i, m in enumerate(text) if m.startswith("Backward sub-tasks on streams"))
    rows = [m.split() for m in text[start + 2:] if m.startswith("  ")]
    assert any(row[:2] == ["conv:", "backward_param.0"] and row[2] == "1" for row in rows)
    assert any(row[:2] == ["deconv:", "backward_data"] and row[2] == "0" for row in rows)
    assert any(re.fullmatch(r"Streamed backward: [0-9.e+-]+ ms \(sub-tasks alone, one after another: "
                            r"[0-9.e+-]+ ms\)", m) for m in text)
    assert any(re.fullmatch(r"Last data gradient at [0-9.e+-]+ ms \(the data gradients alone, one after "
                            r"another: [0-9.e+-]+ ms\)", m) for m in text)
    assert any(re.fullmatch(r"Scheduling cost per sub-task: [0-9.e+-]+ us median, [0-9.e+-]+ us mean .*", m)
               for m in text)
    # a chain: every data gradient at priority 0, weight gradients at -alpha
    assert {row[3] for row in rows if row[1] == "backward_data"} == {"0.000"}
    assert {row[3] for row in rows if row[1] == "backward_param.0"} == {"-0.250"}
    spans = [event for event in events if event["ph"] == "X"]
    assert len(spans) == len(rows) and {event["tid"] for event in spans} <= {0, 1, 2}


def test_time_tuned_prints_each_sub_tasks_thread_counts(capsys, tmp_path, monkeypatch):
    """--schedule tuned: the backward's sub-tasks profiled at each thread count
    (times per count tried, the best and its op type's count), then the
    streamed backward with the threads each sub-task held, in the table and
    the trace."""
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path / "cache"))        # a profile cache of its own
    text, events = time_streamed(capsys, tmp_path, "tuned")
    start = next(i for i, m in enumerate(text) if m.startswith("Thread counts per sub-task"))
    assert re.fullmatch(r"  conv: backward_param\.0 +1: [0-9.]+(, \d+: [0-9.]+)* -> best \d+, its type's \d+",
                        next(m for m in text[start:] if m.startswith("  conv: backward_param.0")))
    table = next(i for i, m in enumerate(text) if m.startswith("Backward sub-tasks on streams"))
    rows = [m.split() for m in text[table + 2:] if m.startswith("  ")]
    assert rows and all(int(row[5]) >= 1 for row in rows)
    assert all(event["args"]["threads"] >= 1 for event in events if event["ph"] == "X")
    assert any(re.match(r"Thread counts per sub-task \(hill climbing over \d+ profiling backwards", m) for m in text)
    again, _ = time_streamed(capsys, tmp_path, "tuned")         # the same net and machine: from the cache
    assert any(m.startswith("Thread counts per sub-task (the profile cached in ") for m in again)


def test_time_trace_needs_the_streams(tmp_path, capsys):
    path = tmp_path / "tiny.prototxt"
    path.write_text(PROFILE_NET)
    code, _, err = run_cct(capsys, "time", "--model", path, "--trace", tmp_path / "t.json")
    assert_one_line_error(code, err, "--trace: needs --schedule streams (or tuned, or auto) and a .json or .png file")


def test_time_shows_the_partitions_a_small_batch_really_runs(tmp_path, capsys, monkeypatch):
    """A deploy net at batch 1 under a configuration asking 2 partitions per
    layer: it runs (one partition each) and the table says so."""
    from helpers.paths import MODELS
    from cct.runtime import settings
    path = tmp_path / "lenet_1.prototxt"
    path.write_text((MODELS / "lenet" / "lenet.prototxt").read_text().replace("dim: 64", "dim: 1", 1))
    config = tmp_path / "run.json"
    config.write_text('{"default": {"partitions": 2}}')
    monkeypatch.setenv(settings.CONFIG_ENV, str(config))
    code, _, err = run_cct(capsys, "time", "--model", path, "--iterations", "1", "--peak_size", "0")
    assert code == 0, err
    text = messages(err)
    start = next(i for i, m in enumerate(text) if m == "Profile per layer:")
    rows = {m.split()[0]: m.split() for m in text[start + 2:start + 11]}
    assert {name: row[-1] for name, row in rows.items()} == {name: "1" for name in rows} and "conv1" in rows
    assert ("Partitions cut to the batch (a partition needs a sample): 2 asked, 1 run on conv1, pool1, conv2, "
            "pool2, ip1, relu1, ip2") in text


SEQUENCE_NET = """name: "sequence"
layer { name: "data" type: "Input" top: "x" top: "cont" top: "target"
        input_param { shape { dim: 6 dim: 4 dim: 5 } shape { dim: 6 dim: 4 } shape { dim: 6 dim: 4 dim: 2 } } }
layer { name: "lstm" type: "LSTM" bottom: "x" bottom: "cont" top: "h"
        recurrent_param { num_output: 8 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "rnn" type: "RNN" bottom: "h" bottom: "cont" top: "o"
        recurrent_param { num_output: 2 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "o" bottom: "target" top: "loss" }
"""


def test_time_times_recurrent_layers_with_their_flops(tmp_path, capsys):
    """The layers' own FLOP counts (Layer.flops) reach the profile. T 6, N 4;
    LSTM D 5, H 8: forward 2 TN 4H D + 2 TN 4H H = 7680 + 12288, backward (its
    bottoms need none) the weight gradients and the gradient through time,
    7680 + 2 x 12288. RNN D 8, H 2: forward 768 + 192 + 192 (output layer),
    backward 768 (h's gradient) + 768 + 2 x 384."""
    path = tmp_path / "sequence.prototxt"
    path.write_text(SEQUENCE_NET)
    code, _, err = run_cct(capsys, "time", "--model", path, "--iterations", "2", "--peak_size", "0")
    assert code == 0, err
    text = messages(err)
    for name in ("lstm", "rnn"):
        assert any(re.fullmatch(rf" *{name}\tbackward: [0-9.e+-]+ ms\.", m) for m in text)
    start = next(i for i, m in enumerate(text) if m == "Profile per layer:")
    end = next(i for i, m in enumerate(text) if m.startswith("Net: "))
    rows = {m.split()[0]: m.split() for m in text[start + 2:end]}
    assert rows["lstm"][1] == "LSTM" and rows["rnn"][1] == "RNN"
    expected = (7680 + 12288) + (7680 + 2 * 12288) + (768 + 192 + 192) + (768 + 768 + 2 * 384)
    assert any(m.startswith(f"Net: {expected / 1e9:.4g} GFLOP per forward-backward") for m in text)


def test_time_names_a_winograd_forward(tmp_path, capsys, monkeypatch):
    """A convolution its net never runs backward, on Winograd (CCT_WINOGRAD=4):
    its lowering column says W4; a convolution that runs backward lowers."""
    path = tmp_path / "deploy.prototxt"
    path.write_text("""
input: "data" input_shape { dim: 2 dim: 3 dim: 10 dim: 10 }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 4 kernel_size: 3 pad: 1 } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
""")
    monkeypatch.setenv("CCT_WINOGRAD", "4")
    code, _, err = run_cct(capsys, "time", "--model", path, "--iterations", "1", "--peak_size", "0",
                           "--phase", "TEST")
    assert code == 0, err
    text = messages(err)
    start = next(i for i, m in enumerate(text) if m.startswith("Profile per layer"))
    rows = {m.split()[0]: m.split() for m in text[start + 2:] if m.split() and m.split()[0] in ("conv", "relu")}
    assert rows["conv"][-2] == "W4"


# --- the start-up --------------------------------------------------------------------------------
START_UP = re.compile(r"Start-up: net construction ([0-9.e+-]+) ms, weights (none|[0-9.e+-]+ ms), first forward "
                      r"([0-9.e+-]+) ms \(([0-9.e+-]+) ms over the average forward, ([0-9.]+|inf)x\)\.")


def test_time_reports_the_start_up_apart(run_folder, capsys):
    """Construction, weights and the first forward's extra cost, each in ms:
    the weights "none" without --weights, and the extra is the first
    forward less Caffe's "Average Forward pass"."""
    import cct
    cct.Net("net.prototxt", cct.TRAIN).save(str(run_folder / "net.caffemodel"))
    for flags, weighted in (((), False), (("--weights", "net.caffemodel"), True)):
        code, _, err = run_cct(capsys, "time", "--model", "net.prototxt", "--iterations", "2", "--peak_size", "0",
                               *flags)
        assert code == 0, err
        text = messages(err)
        found = [START_UP.fullmatch(m) for m in text if m.startswith("Start-up: ")]
        assert len(found) == 1 and found[0], text
        construction, weights, first, extra, _ = found[0].groups()
        assert float(construction) > 0 and float(first) > 0
        assert (weights != "none" and float(weights.split()[0]) > 0) == weighted
        average = next(float(m.split()[3]) for m in text if m.startswith("Average Forward pass: "))
        assert float(extra) == pytest.approx(float(first) - average, abs=2e-3)
        assert text.index(found[0].group(0)) > text.index("*** Benchmark begins ***")
