"""cct's metadata is in setup.cfg. This file only adds cct_caffe_finder.pth to
site-packages, for a regular and for an editable install alike: setup.cfg cannot
(`[options.data_files]` lands under sys.prefix, not in site-packages, and is
left out of an editable wheel). The .pth puts cct's `import caffe` finder first
on sys.meta_path at start-up (cct_caffe_finder.py says why)."""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "cct_caffe_finder.pth"
# site runs a .pth's `import` lines at every start-up: this one only defines the
# finder, which imports cct_caffe_finder when, and only when, `caffe` is imported.
PTH_TEXT = (b"# cct: `import caffe` gives a built pycaffe, else cct (cct_caffe_finder.py says how)\n"
            b"import sys; sys.meta_path.insert(0, type('CctCaffeFinder', (), {'find_spec': staticmethod("
            b"lambda name, *rest: __import__('cct_caffe_finder').find_spec(name) if name == 'caffe' else None)}))\n")


class BuildPyWithPth(build_py):
    """A regular wheel: the .pth at the wheel's root, which installs into site-packages."""

    def run(self):
        super().run()
        if not self.editable_mode:       # an editable build's build_lib is thrown away
            Path(self.build_lib, PTH).write_bytes(PTH_TEXT)


class WithPth:
    """An editable-install strategy (setuptools' EditableStrategy protocol) that
    writes the .pth beside what the strategy it wraps writes."""

    def __init__(self, strategy):
        self.strategy = strategy

    def __call__(self, wheel, files, mapping):
        self.strategy(wheel, files, mapping)
        wheel.writestr(PTH, PTH_TEXT)

    def __enter__(self):
        self.strategy.__enter__()
        return self

    def __exit__(self, *exception):
        return self.strategy.__exit__(*exception)


class EditableWheelWithPth(editable_wheel):
    """An editable wheel: the .pth beside setuptools' own editable finder and its .pth."""

    def _select_strategy(self, *args, **kwargs):
        # setuptools' own (private: its arguments are passed on as they come)
        return WithPth(super()._select_strategy(*args, **kwargs))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
