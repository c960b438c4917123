"""`import caffe` gives cct (caffe.py, installed beside cct): the same module
objects, not copies; a real pycaffe (a `caffe` package) anywhere on sys.path
wins; CCT_CAFFE_ALIAS=0 turns the alias off. The sys.path cases run in fresh
interpreters, with a fake pycaffe package made for the test."""
import importlib
import os
import shutil
import subprocess
import sys

import pytest

import cct
from cct.core import caffe_name
from helpers.paths import REPO

# pycaffe's module names (python/caffe/*.py and caffe.proto.caffe_pb2)
PYCAFFE_MODULES = ("io", "proto", "proto.caffe_pb2", "net_spec", "draw", "classifier", "detector", "coord_map",
                   "pycaffe")
FAKE_PYCAFFE = "REAL_PYCAFFE = True\n"


def test_import_caffe_is_cct_with_the_same_module_objects():
    import caffe
    from caffe import layers as L, params as P
    from caffe.proto import caffe_pb2
    assert caffe is cct and caffe.Net is cct.Net and caffe.Layer is cct.Layer
    assert caffe.__cct_version__ == cct.__version__
    assert (L, P, caffe_pb2) == (cct.layers, cct.params, cct.proto.caffe_pb2)
    for name in PYCAFFE_MODULES:
        assert sys.modules[f"caffe.{name}"] is importlib.import_module(f"cct.{name}"), name
    assert importlib.import_module("caffe.io") is cct.io


def python(code, tmp_path, pythonpath=(), **env):
    """Run `code` in a fresh interpreter in tmp_path (so the repository is not on
    its path unless given); returns its stdout, stripped."""
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", caffe_name.ALIAS_ENV)}
    environment.update(env)
    if pythonpath:
        environment["PYTHONPATH"] = os.pathsep.join(str(path) for path in pythonpath)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def fake_pycaffe(folder):
    (folder / "caffe").mkdir(parents=True)
    (folder / "caffe" / "__init__.py").write_text(FAKE_PYCAFFE)
    return folder


WHICH = ("import sys, caffe; print(getattr(caffe, 'REAL_PYCAFFE', False), hasattr(caffe, '__cct_version__'), "
         "'cct' in sys.modules)")


def test_installed_alias_is_found_outside_the_repository(tmp_path):
    code = ("import sys, caffe, cct, caffe.coord_map, cct.cli.train_log as a, caffe.cli.train_log as b; "
            "print(caffe is cct, a is b, b.__spec__.name, caffe.__cct_alias__.endswith('caffe.py'))")
    assert python(code, tmp_path) == "True True cct.cli.train_log True"


def test_a_real_pycaffe_earlier_on_the_path_wins_without_touching_cct(tmp_path):
    assert python(WHICH, tmp_path, [fake_pycaffe(tmp_path / "pycaffe")]) == "True False False"


def test_a_real_pycaffe_later_on_the_path_wins_through_the_alias(tmp_path):
    """cct in a virtualenv, Caffe from the system's packages: the alias steps aside."""
    fake = fake_pycaffe(tmp_path / "pycaffe")
    (fake / "caffe" / "io.py").write_text("")
    submodule = "; import caffe.io; print(caffe.io.__file__ == %r)" % str(fake / "caffe" / "io.py")
    assert python(WHICH + submodule, tmp_path, [REPO, fake]) == "True False True\nTrue"
    assert python(WHICH, tmp_path, [REPO, fake], CCT_CAFFE_ALIAS="0") == "True False True"


def test_a_real_pycaffe_in_the_same_folder_wins(tmp_path):
    folder = fake_pycaffe(tmp_path / "site")
    shutil.copy(REPO / "caffe.py", folder / "caffe.py")
    assert python(WHICH, tmp_path, [folder]) == "True False False"


def test_a_caffe_folder_that_is_not_a_package_does_not_stop_the_alias(tmp_path):
    """A `caffe/` folder without __init__.py (pycaffe's tests, copied out alone) is
    no pycaffe. (Python prefers a module on the path to such a folder; an editable
    install's alias is no path entry, so there the folder would win.)"""
    (tmp_path / "src" / "caffe" / "test").mkdir(parents=True)
    (tmp_path / "site").mkdir()
    shutil.copy(REPO / "caffe.py", tmp_path / "site" / "caffe.py")     # as installed in site-packages
    assert python(WHICH, tmp_path, [tmp_path / "src", tmp_path / "site"]) == "False True True"


def test_the_alias_turned_off(tmp_path):
    code = ("try:\n    import caffe\nexcept ModuleNotFoundError as error:\n    print(error.name, error)")
    assert python(code, tmp_path, CCT_CAFFE_ALIAS="0") == (
        "caffe No module named 'caffe' (cct's alias is turned off by CCT_CAFFE_ALIAS=0)")


@pytest.mark.parametrize("setting, enabled", [(None, True), ("1", True), ("0", False), ("off", False),
                                              ("False", False)])
def test_alias_enabled_reads_the_environment(monkeypatch, setting, enabled):
    if setting is None:
        monkeypatch.delenv(caffe_name.ALIAS_ENV, raising=False)
    else:
        monkeypatch.setenv(caffe_name.ALIAS_ENV, setting)
    assert caffe_name.alias_enabled() is enabled


@pytest.mark.slow
def test_caffe_import_says_which_module_answers(tmp_path):
    code = "from cct.core.caffe_name import caffe_import; print(caffe_import())"
    assert python(code, tmp_path).startswith("cct, through its alias ")
    assert python(code, tmp_path, CCT_CAFFE_ALIAS="0") == (
        "no module named 'caffe' (cct's alias is turned off: CCT_CAFFE_ALIAS=0)")
    fake = fake_pycaffe(tmp_path / "pycaffe")
    assert python(code, tmp_path, [fake]).startswith(f"pycaffe at {fake / 'caffe'} (Caffe's own")
    loaded = "import caffe; " + code
    assert python(loaded, tmp_path).startswith(f"cct {cct.__version__}, through its alias ")
    assert python(loaded, tmp_path, [fake]).startswith(f"pycaffe at {fake / 'caffe'} (loaded; not cct)")
