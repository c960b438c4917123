"""The folder the `cct` command tests run in."""
import pytest

from helpers.linreg import net_text


@pytest.fixture
def run_folder(tmp_path, monkeypatch):
    """A folder with net.prototxt (Input + TestLinReg, helpers.linreg) and
    solver.prototxt (4 iterations, snapshots and tests every 2), as the working folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(net_text())
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt" base_lr: 0.01 lr_policy: "fixed" momentum: 0.9 max_iter: 4 display: 2 '
        'snapshot: 2 snapshot_prefix: "snap" test_iter: 2 test_interval: 2 random_seed: 1')
    return tmp_path
