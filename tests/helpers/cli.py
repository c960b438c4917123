"""Running `cct` in-process (cct.cli.main) and reading what it wrote to stderr:
glog-style log lines, and the one `cct: error: ...` line a refused run ends with."""
import re

from cct import cli

LOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} \w+\] ")


def run_cct(capsys, *argv):
    """(exit status, stdout, stderr) of `cct argv...`."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def messages(err):
    """Log lines without their glog-style prefix."""
    return [LOG_LINE.sub("", line) for line in err.splitlines() if LOG_LINE.match(line)]


def assert_one_line_error(code, err, *fragments):
    """Exit status 1, no traceback, and stderr ending in its only `cct: error:` line,
    which holds every fragment."""
    assert code == 1, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("cct: error: ")]
    assert len(errors) == 1 and err.rstrip().splitlines()[-1] == errors[0], err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
