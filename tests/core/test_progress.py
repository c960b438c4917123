"""cct.core.progress: a tqdm bar on a terminal, plain log lines otherwise; and
the long commands (convert_imageset, compute_image_mean, digits, cct test)
reporting through it."""
import io
import logging

import pytest
from PIL import Image

import cct
from cct import cli
from cct.core.progress import Progress
from helpers.linreg import net_text


class Terminal(io.StringIO):
    def isatty(self):
        return True


def progress_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "cct.progress"]


def count_through(progress, items):
    with progress as shown:
        for _ in shown.track(items):
            pass


def test_log_lines_every_tenth_when_not_a_terminal(caplog):
    stream = io.StringIO()
    with caplog.at_level(logging.INFO, logger="cct"):
        count_through(Progress("job", total=20, unit="images", stream=stream), range(20))
    lines = progress_lines(caplog)
    assert [line.split(",")[0] for line in lines[:-1]] == [f"job: {n}/20 images ({5 * n}%)" for n in range(2, 20, 2)]
    assert lines[-1].startswith("job: 20/20 images (100%) done in ")
    assert stream.getvalue() == ""                      # no bar in a log file


def test_unknown_total_and_explicit_every(caplog):
    with caplog.at_level(logging.INFO, logger="cct"):
        count_through(Progress("scan", unit="records", every=3, stream=io.StringIO()), iter(range(7)))
    lines = progress_lines(caplog)
    assert [line.split(",")[0] for line in lines[:-1]] == ["scan: 3 records", "scan: 6 records"]
    assert lines[-1].startswith("scan: 7 records done in ")


def test_chunked_updates_log_once_per_step(caplog):
    with caplog.at_level(logging.INFO, logger="cct"):
        with Progress("render", total=100, unit="images", stream=io.StringIO()) as shown:
            shown.update(35)
            shown.update(65)
    assert [line.split(",")[0] for line in progress_lines(caplog)][0] == "render: 35/100 images (35%)"
    assert len(progress_lines(caplog)) == 2


def test_failure_logs_no_end_line(caplog):
    with caplog.at_level(logging.INFO, logger="cct"), pytest.raises(ValueError):
        with Progress("job", total=100, stream=io.StringIO()) as shown:
            shown.update(5)
            raise ValueError("stop")
    assert progress_lines(caplog) == []


def test_terminal_gets_a_bar_and_no_log_lines(caplog):
    stream = Terminal()
    with caplog.at_level(logging.INFO, logger="cct"):
        count_through(Progress("job", total=4, unit="images", stream=stream), range(4))
    assert "job: 100%" in stream.getvalue() and "4/4" in stream.getvalue()
    assert progress_lines(caplog) == []


def test_terminal_prints_log_lines_above_the_bar(monkeypatch):
    stream = Terminal()
    monkeypatch.setattr("sys.stderr", stream)
    logger = logging.getLogger("cct")
    handler = logging.StreamHandler(stream)          # as the CLI installs it: on "cct", to stderr
    logger.addHandler(handler)
    root_handlers = list(logging.getLogger().handlers)
    try:
        with Progress("job", total=2, stream=stream) as shown:
            # Through tqdm.write while the bar is up, which clears the bar line first.
            assert handler not in logger.handlers
            assert logging.getLogger().handlers == root_handlers      # no console there: no second copy
            logging.getLogger("cct.cli").warning("a message")
            shown.update(2)
        assert handler in logger.handlers            # put back as it was
    finally:
        logger.removeHandler(handler)
    assert "a message\n" in stream.getvalue()


# --- the commands ----------------------------------------------------------------------------------
def test_convert_imageset_and_compute_image_mean_log_progress(tmp_path, caplog):
    from cct.cli.datasets import compute_image_mean, convert_imageset
    (tmp_path / "root").mkdir()
    for index in range(4):
        Image.new("RGB", (5, 6), (index, 2 * index, 3 * index)).save(tmp_path / "root" / f"{index}.png")
    (tmp_path / "list.txt").write_text("".join(f"{index}.png {index}\n" for index in range(4)))
    root, listing = f"{tmp_path / 'root'}/", str(tmp_path / "list.txt")
    with caplog.at_level(logging.INFO, logger="cct"):
        assert convert_imageset([root, listing, str(tmp_path / "db")]) == 0
        assert compute_image_mean([str(tmp_path / "db"), str(tmp_path / "mean.binaryproto")]) == 0
    lines = progress_lines(caplog)
    assert any(line.startswith("convert_imageset: 4/4 images (100%) done in ") for line in lines)
    assert any(line.startswith("compute_image_mean: 4/4 images (100%) done in ") for line in lines)


def test_digits_logs_progress(caplog):
    from cct.data import digits
    with caplog.at_level(logging.INFO, logger="cct"):
        digits.make_digits(train_count=30, test_count=10, seed=0)
    lines = progress_lines(caplog)
    assert any(line.startswith("digits: train: 30/30 images (100%) done") for line in lines)
    assert any(line.startswith("digits: test: 10/10 images (100%) done") for line in lines)


def test_cct_test_logs_progress(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(net_text())
    net = cct.Net("net.prototxt", cct.TEST)
    net.save("net.caffemodel")
    code = cli.main(["test", "--model=net.prototxt", "--weights=net.caffemodel", "--iterations=20"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "progress] test: 2/20 batches (10%)" in err
    assert "progress] test: 20/20 batches (100%) done in " in err
    assert "Batch 19, loss = " in err
