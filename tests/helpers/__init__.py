"""Code the test files share: plain modules, imported as `from helpers.<module>
import ...` (tests/conftest.py puts tests/ on sys.path; pytest runs with
--import-mode=importlib, so test files never import each other).

    registry   test-only layer types, registered once per process
    linreg     the solver tests' linear-regression net, its test-only layers
               and a float64 textbook version of every update rule
    layers     one layer run on arrays (set up, reshape, forward); Echo, a
               Python layer class in an importable module
    data       small data sources on disk: LMDBs of Datums, PNG folders with
               list files, HDF5 lists, window files; data layers read back
    reference  BVLC Caffe's reference cases (tests/reference/cases)
    protos     prototxt text in, messages out, compared as text
    cli        running `cct` in-process and reading its glog-style lines
    nets       net texts more than one test file builds
    paths      the repository's folders (models/)
Fixtures live in conftest.py files: `partitions` in tests/conftest.py,
`run_folder` (a working folder for `cct` commands) in tests/cli/conftest.py."""
