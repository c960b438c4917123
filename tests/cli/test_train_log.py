"""The training-log tools (cct.cli.train_log): `cct train`'s log in Caffe's
format, parse_log on it and on a Caffe log, plot_training_log."""
import importlib.util
import re

import pytest

from helpers.cli import LOG_LINE, assert_one_line_error, messages, run_cct


def test_train_log_format_and_parse_log(run_folder, capsys):
    code, _, err = run_cct(capsys, "train", "--solver", "solver.prototxt")
    assert code == 0
    lines = err.splitlines()
    assert all(LOG_LINE.match(line) for line in lines), lines
    text = messages(err)
    assert any(re.fullmatch(r"Iteration 2 \(.* iter/s, .* images/s, .*s/2 iters.*\), loss = \S+", m) for m in text)
    assert any(re.fullmatch(r"    Train net output #0: loss = \S+ \(\* 1 = \S+ loss\)", m) for m in text)
    assert any(re.fullmatch(r"    Test net output #0: loss = \S+ \(\* 1 = \S+ loss\)", m) for m in text)
    assert "Iteration 2, lr = 0.01" in text
    (run_folder / "train.log").write_text(err)
    code, _, err = run_cct(capsys, "parse_log", "train.log", str(run_folder))
    assert code == 0, err
    train = (run_folder / "train.log.train").read_text().splitlines()
    test = (run_folder / "train.log.test").read_text().splitlines()
    assert train[0] == "NumIters,Seconds,LearningRate,loss"
    assert [row.split(",")[0] for row in train[1:]] == ["0", "2"]
    assert all(row.split(",")[2] == "0.01" for row in train[1:])
    assert [row.split(",")[0] for row in test[1:]] == ["0", "2", "4"]


def test_parse_log_reads_caffe_logs(tmp_path):
    from cct.cli.train_log import parse_log
    log = tmp_path / "caffe.log"
    log.write_text(
        "I1231 23:59:59.500000  1234 solver.cpp:330] Iteration 0, Testing net (#0)\n"
        "I1231 23:59:59.900000  1234 solver.cpp:397]     Test net output #0: accuracy = 0.1\n"
        "I1231 23:59:59.900000  1234 solver.cpp:397]     Test net output #1: loss = 2.3 (* 1 = 2.3 loss)\n"
        "I1231 23:59:59.950000  1234 solver.cpp:218] Iteration 0 (0 iter/s, 0.4s/100 iters), loss = 2.31\n"
        "I1231 23:59:59.950000  1234 solver.cpp:237]     Train net output #0: loss = 2.31 (* 1 = 2.31 loss)\n"
        "I1231 23:59:59.950000  1234 sgd_solver.cpp:105] Iteration 0, lr = 0.01\n"
        "I0101 00:00:01.500000  1234 solver.cpp:218] Iteration 100 (50 iter/s, 2s/100 iters), loss = 0.5\n"
        "I0101 00:00:01.500000  1234 solver.cpp:237]     Train net output #0: loss = 0.4 (* 1 = 0.4 loss)\n"
        "I0101 00:00:01.500000  1234 sgd_solver.cpp:105] Iteration 100, lr = 0.009\n")
    train, test = parse_log(log)
    assert [(r["NumIters"], r["LearningRate"], r["loss"]) for r in train] == [(0, 0.01, 2.31), (100, 0.009, 0.4)]
    assert train[1]["Seconds"] == pytest.approx(2.0)          # across the new year
    assert test == [{"NumIters": 0, "Seconds": pytest.approx(0.4), "accuracy": 0.1, "loss": 2.3,
                     "LearningRate": 0.01}]


def test_plot_training_log(run_folder, capsys):
    code, _, err = run_cct(capsys, "train", "--solver", "solver.prototxt")
    assert code == 0, err
    (run_folder / "train.log").write_text(err)
    code, _, err = run_cct(capsys, "plot_training_log", "train.log", "plot.png")
    if importlib.util.find_spec("matplotlib") is None:
        assert_one_line_error(code, err, "plot_training_log needs matplotlib")
    else:
        assert code == 0, err
        assert (run_folder / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
