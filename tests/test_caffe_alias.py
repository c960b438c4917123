"""`import caffe` gives cct (caffe.py, installed beside cct): the same module
objects, not copies; a built pycaffe (a `caffe` package holding `_caffe`)
anywhere on sys.path wins; cct stands in for an unbuilt one and passes over a
`caffe` folder without __init__.py; CCT_CAFFE_ALIAS=0 turns the alias off. The
sys.path cases run in fresh interpreters, with fake pycaffe packages made for the
test, under cct_caffe_finder.pth as installed (a regular install simulated by
copying; the slow tests install the checkout, regular and editable, into new
virtual environments)."""
import ast
import importlib
import os
import shutil
import subprocess
import sys
import sysconfig

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


def run_python(code, tmp_path, pythonpath=(), executable=sys.executable, **env):
    """Run `code` in a fresh interpreter in tmp_path (so the repository is not on
    its path unless given); returns the finished process."""
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", caffe_name.ALIAS_ENV)}
    environment.update(env)
    if pythonpath:
        environment["PYTHONPATH"] = os.pathsep.join(str(path) for path in pythonpath)
    return subprocess.run([str(executable), "-c", code], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=120)


def python(code, tmp_path, pythonpath=(), **env):
    """Run `code` as run_python does; returns its stdout, stripped."""
    done = run_python(code, tmp_path, pythonpath, **env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def fake_pycaffe(folder, built=True):
    """A `caffe` package in folder; built: with the `_caffe` module its __init__
    imports first, as BVLC's does (without it: BVLC's tree, never built)."""
    (folder / "caffe").mkdir(parents=True)
    (folder / "caffe" / "__init__.py").write_text("from ._caffe import Net  # noqa\n" + FAKE_PYCAFFE)
    if built:
        (folder / "caffe" / "_caffe.py").write_text("Net = object\n")
    return folder


def data_only_caffe(root):
    """A caffe_root whose python/caffe holds data files only (no __init__.py)."""
    (root / "python" / "caffe" / "imagenet").mkdir(parents=True)
    (root / "python" / "caffe" / "imagenet" / "ilsvrc_2012_mean.npy").write_bytes(b"")
    return root


def pth_text():
    """cct_caffe_finder.pth's text, as setup.py writes it into site-packages."""
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "PTH_TEXT":
            return ast.literal_eval(node.value).decode()
    raise AssertionError("setup.py defines no PTH_TEXT")


def installed_site(folder):
    """A folder laid out as a regular install leaves site-packages (cct itself
    comes from this interpreter's install): code run with site_prefix(folder)
    sees it as Python's start-up does, its .pth included."""
    folder.mkdir()
    for name in ("caffe.py", "cct_caffe_finder.py"):
        shutil.copy(REPO / name, folder / name)
    (folder / "cct_caffe_finder.pth").write_text(pth_text())
    return folder


def site_prefix(folder, first=None):
    """Code that processes folder as a site dir, then puts `first` at sys.path[0]
    (BVLC's notebooks: `sys.path.insert(0, caffe_root + 'python')`)."""
    insert = f"sys.path.insert(0, {str(first)!r}); " if first else ""
    return f"import site, sys; site.addsitedir({str(folder)!r}); {insert}"


WHICH = ("import sys, caffe; print(getattr(caffe, 'REAL_PYCAFFE', False), hasattr(caffe, '__cct_version__'), "
         "'cct' in sys.modules)")


def test_installed_alias_is_found_outside_the_repository(tmp_path):
    code = ("import sys, caffe, cct, caffe.coord_map, cct.cli.train_log as a, caffe.cli.train_log as b; "
            "print(caffe is cct, a is b, b.__spec__.name, caffe.__cct_alias__.endswith('caffe.py'))")
    assert python(code, tmp_path) == "True True cct.cli.train_log True"


def test_a_real_pycaffe_earlier_on_the_path_wins_without_touching_cct(tmp_path):
    assert python(WHICH, tmp_path, [fake_pycaffe(tmp_path / "pycaffe")]) == "True False False"


def test_a_real_pycaffe_later_on_the_path_wins_through_the_alias(tmp_path):
    """cct in a virtualenv, Caffe from the system's packages: the real one wins.
    Where the install's finder (cct_caffe_finder.pth) is on sys.meta_path it
    answers before cct is imported; where not, the alias imports cct, then
    steps aside."""
    fake = fake_pycaffe(tmp_path / "pycaffe")
    (fake / "caffe" / "io.py").write_text("")
    submodule = "; import caffe.io; print(caffe.io.__file__ == %r)" % str(fake / "caffe" / "io.py")
    finder = "; print(any(getattr(f, '__name__', '') == 'CctCaffeFinder' for f in sys.meta_path))"
    found = python(WHICH + submodule + finder, tmp_path, [REPO, fake]).split("\n")
    cct_imported = str(found[2] != "True")
    assert found[:2] == [f"True False {cct_imported}", "True"]
    assert python(WHICH, tmp_path, [REPO, fake], CCT_CAFFE_ALIAS="0").startswith("True False ")


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


STAND_IN = "import caffe: cct stands in for Caffe's {}, which has no built _caffe extension (`make pycaffe` builds it)"


def test_a_data_only_caffe_folder_first_on_the_path_gives_cct(tmp_path):
    root = data_only_caffe(tmp_path / "caffe_root")
    code = site_prefix(installed_site(tmp_path / "site"), root / "python") + WHICH
    assert python(code, tmp_path) == "False True True"


def test_an_unbuilt_caffe_tree_first_on_the_path_gives_cct_and_says_so(tmp_path):
    tree = fake_pycaffe(tmp_path / "caffe_root" / "python", built=False)
    code = site_prefix(installed_site(tmp_path / "site"), tree) + WHICH
    done = run_python(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False True True"
    assert done.stderr.splitlines() == [STAND_IN.format(tree / "caffe")]


def test_a_built_pycaffe_first_on_the_path_wins_without_touching_cct(tmp_path):
    code = site_prefix(installed_site(tmp_path / "site"), fake_pycaffe(tmp_path / "pycaffe")) + WHICH
    assert python(code, tmp_path) == "True False False"


def test_a_built_pycaffe_later_on_the_path_wins_without_touching_cct(tmp_path):
    """cct in a virtualenv, Caffe from the system's packages: the finder gives it, caffe.py never runs."""
    code = site_prefix(installed_site(tmp_path / "site")) + f"sys.path.append({str(tmp_path / 'pycaffe')!r}); "
    fake_pycaffe(tmp_path / "pycaffe")
    assert python(code + WHICH, tmp_path) == "True False False"


def test_the_alias_turned_off_under_the_finder(tmp_path):
    site = installed_site(tmp_path / "site")
    code = site_prefix(site) + "import caffe"
    done = run_python(code, tmp_path, CCT_CAFFE_ALIAS="0")
    assert "No module named 'caffe' (cct's alias is turned off by CCT_CAFFE_ALIAS=0)" in done.stderr
    tree = fake_pycaffe(tmp_path / "caffe_root" / "python", built=False)
    done = run_python(site_prefix(site, tree) + "import caffe", tmp_path, CCT_CAFFE_ALIAS="0")
    assert "No module named 'caffe._caffe'" in done.stderr    # as without cct


def install_checkout(venv, editable):
    """Install this checkout (a copy of what the build reads) into a new virtual
    environment, without pip or dependencies of its own: cct's dependencies, pip
    and setuptools come from this interpreter's site-packages through a path
    entry (a plain line: that folder's own .pth files are not run)."""
    source = venv.parent / "source"
    source.mkdir()
    for name in ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "caffe.py", "cct_caffe_finder.py"):
        shutil.copy(REPO / name, source / name)
    for name in ("cct", "layers", "lowering", "proto"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python_bin = venv / "bin" / "python"
    site_packages = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site_packages / "zz_cct_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # -I: this interpreter's own cct install is on that path; pip must not touch it
    command = [str(python_bin), "-m", "pip", "install", "-q", "-I", "--no-deps", "--no-build-isolation",
               "--no-index"] + (["-e"] if editable else []) + [str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return python_bin, site_packages


@pytest.mark.slow
@pytest.mark.parametrize("editable", [False, True], ids=["regular", "editable"])
def test_an_install_gives_cct_wherever_a_built_pycaffe_is_not(tmp_path, editable):
    python_bin, site_packages = install_checkout(tmp_path / "venv", editable)
    assert (site_packages / "cct_caffe_finder.pth").read_text() == pth_text()
    work = tmp_path / "work"
    work.mkdir()
    notebook = "import sys; sys.path.insert(0, {!r}); "

    def which(first=None, **env):
        done = run_python((notebook.format(str(first)) if first else "") + WHICH, work, executable=python_bin, **env)
        return done.stdout.strip(), done.stderr.strip()

    assert which() == ("False True True", "")
    assert which(data_only_caffe(tmp_path / "caffe_root") / "python") == ("False True True", "")
    tree = fake_pycaffe(tmp_path / "bvlc" / "python", built=False)
    assert which(tree) == ("False True True", STAND_IN.format(tree / "caffe"))
    assert which(fake_pycaffe(tmp_path / "built" / "python")) == ("True False False", "")
    assert "turned off by CCT_CAFFE_ALIAS=0" in which(CCT_CAFFE_ALIAS="0")[1]
