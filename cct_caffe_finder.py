"""Which module `import caffe` gives, decided before Python's own path search.

cct's install (regular or editable: setup.py) writes cct_caffe_finder.pth into
site-packages; at every start-up it puts a finder first on sys.meta_path that
answers the one name `caffe` through find_spec() here, from sys.path:
- the first `caffe` package that holds a `_caffe` module (a built pycaffe),
  anywhere on the path: Caffe's own, and cct is not imported;
- else cct's alias (caffe.py, beside this file), which also stands in for a
  `caffe` package without `_caffe` (BVLC's source tree, never built) and passes
  over a `caffe` folder without __init__.py (a namespace: data files only).
First on sys.meta_path because a namespace folder found by Python's path search
beats setuptools' editable finder, which comes after it, and a package earlier on
the path beats a module later on it. Without the finder (python -S, an install
made before it), caffe.py decides the same once Python's search reaches it.
The .pth's finder is defined in the .pth itself and imports this module only at
`import caffe`: looking a module up at start-up would list site-packages (1.5 ms).
Standard library only."""
import sys

BUILT_MODULE = "_caffe"          # pycaffe's C++ extension: `make pycaffe` builds it into python/caffe


def caffe_packages():
    """The specs of the `caffe` packages (folders with __init__.py) on sys.path,
    in path order. One entry at a time: a whole-path search stops at the first
    `caffe` of any kind (the alias, a namespace folder)."""
    from importlib.machinery import PathFinder
    for entry in list(sys.path):
        spec = PathFinder.find_spec("caffe", [entry])
        if spec is not None and spec.origin and spec.submodule_search_locations is not None:
            yield spec


def is_built(package):
    """Whether a `caffe` package holds a `_caffe` module (an extension, or any
    module of that name): pycaffe's __init__ imports it first thing."""
    from importlib.machinery import PathFinder
    spec = PathFinder.find_spec(BUILT_MODULE, list(package.submodule_search_locations))
    return spec is not None and spec.origin is not None


def resolve():
    """(the first built pycaffe's spec, or None; the first unbuilt `caffe`
    package's spec, or None): a built one anywhere on the path wins."""
    unbuilt = None
    for package in caffe_packages():
        if is_built(package):
            return package, None
        unbuilt = unbuilt or package
    return None, unbuilt


def alias_spec():
    """The spec of cct's caffe.py, beside this file in both install kinds."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "caffe.py")
    return importlib.util.spec_from_file_location("caffe", path) if os.path.isfile(path) else None


def find_spec(fullname):
    """What `import caffe` gives: a built pycaffe, else cct's alias. The finder
    that the .pth puts first on sys.meta_path calls this for the name `caffe` only."""
    real = resolve()[0]
    return real if real is not None else alias_spec()
