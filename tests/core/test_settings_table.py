"""The settings table (cct.core.settings), checked from the table itself:
for every knob and every pair of the sources it has, the earlier source in
the documented precedence wins; a bad value from each source is an error
naming that source; an unknown key or knob is an error naming it; and no
module but the table reads a CCT_ variable."""
import itertools
import json
import re
from pathlib import Path

import pytest

from cct.core import settings
from cct.core.errors import ConfigError
from cct.core.settings import KNOBS, LAYER, NET, override, source_value

ORDER = ("call", "layer", "default", "config", "environment", "built-in")
LAYER_NAME = "conv1"

# Per kind: two valid values, each with its text for a variable (None: not
# expressible there), and a bad value for each source (None: none there).
GOOD = {
    settings.Switch: [(True, "1"), (False, "0")],
    settings.Count: [(3, "3"), (5, "5")],
    settings.Positive: [(3.0, "3"), (5.0, "5")],
    settings.Bytes: [(1024, "1K"), (3 << 20, "3M")],
    settings.Text: [("/a", "/a"), ("/b", "/b")],
    settings.Shares: [(True, "1"), (False, "0")],
    settings.Priorities: [({"alpha": 1.0}, None), ({"beta": 2.0}, None)],
    settings.Devices: [([0], "0"), ([1, 2], "1,2")],
}
BAD = {                                  # (bad value for a call or the file, bad text for a variable)
    settings.Switch: ("maybe", "maybe"),
    settings.Count: (-1, "x"),
    settings.Positive: (-1, "x"),
    settings.Bytes: (-1, "x"),
    settings.Text: (5, None),
    settings.Shares: ({"conv1": 2}, "maybe"),
    settings.Priorities: ({"gamma": 1}, None),
    settings.Devices: ([-1], "x"),
    settings.Choice: ("nope", "nope"),
}
TABLE_KNOBS = [knob for knob in KNOBS if knob.name != "config"]     # config names the file: its own test


def good(knob):
    """Two distinct valid values for `knob`, with their text for a variable."""
    if isinstance(knob.kind, settings.Choice):
        words = list(knob.kind.words.items())
        return [(value, text) for text, value in words[:2]]
    return GOOD[type(knob.kind)]


def sources_of(knob):
    """The sources `knob` has, in precedence order."""
    has = {"call": True, "layer": knob.scope == LAYER, "default": knob.scope == LAYER,
           "config": knob.scope == NET, "environment": knob.env is not None, "built-in": True}
    return [source for source in ORDER if has[source]]


def setting_up(knob, source, value, text, monkeypatch, tmp_path, contents):
    """Set `knob` to `value` in `source`; the file's contents are gathered in `contents`."""
    if source == "call":
        return override(**{knob.name: value})
    if source == "layer":
        contents.setdefault("layers", {}).setdefault(LAYER_NAME, {})[knob.name] = value
    elif source == "default":
        contents.setdefault("default", {})[knob.name] = value
    elif source == "config":
        contents[knob.name] = value
    elif source == "environment":
        monkeypatch.setenv(knob.env, text)
    return None


def pairs():
    for knob in TABLE_KNOBS:
        for first, second in itertools.combinations(sources_of(knob), 2):
            if second == "environment" and good(knob)[1][1] is None:
                continue
            yield pytest.param(knob, first, second, id=f"{knob.name}-{first}-over-{second}")


@pytest.mark.parametrize("knob, first, second", list(pairs()))
def test_the_earlier_source_wins(knob, first, second, monkeypatch, tmp_path):
    (winner, winner_text), (loser, loser_text) = good(knob)
    for name in (k.env for k in KNOBS if k.env):
        monkeypatch.delenv(name, raising=False)
    contents = {}
    contexts = [setting_up(knob, source, value, text, monkeypatch, tmp_path, contents)
                for source, value, text in ((second, loser, loser_text), (first, winner, winner_text))]
    if contents:
        path = tmp_path / "run.json"
        path.write_text(json.dumps(contents))
        monkeypatch.setenv("CCT_CONFIG", str(path))
    expected = knob.default if first == "built-in" else winner
    with contexts[1] or _nothing(), contexts[0] or _nothing():
        assert source_value(knob.name, LAYER_NAME) == (first, expected)


def _nothing():
    return override()


def bad_cases():
    for knob in TABLE_KNOBS:
        kind = next(k for k in BAD if isinstance(knob.kind, k))
        bad_value, bad_text = BAD[kind]
        for source in sources_of(knob):
            if source == "built-in" or (source == "environment" and bad_text is None):
                continue
            yield pytest.param(knob, source, bad_value, bad_text, id=f"{knob.name}-{source}")


@pytest.mark.parametrize("knob, source, bad_value, bad_text", list(bad_cases()))
def test_a_bad_value_is_an_error_naming_its_source(knob, source, bad_value, bad_text, monkeypatch, tmp_path):
    where = {"call": "override", "layer": f"run.json: layers.{LAYER_NAME}.{knob.name}",
             "default": f"run.json: default.{knob.name}", "config": f"run.json: {knob.name}",
             "environment": f"environment variable {knob.env}"}[source]
    contents = {}
    with pytest.raises(ConfigError) as refused:
        context = setting_up(knob, source, bad_value, bad_text, monkeypatch, tmp_path, contents)
        if contents:
            (tmp_path / "run.json").write_text(json.dumps(contents))
            monkeypatch.setenv("CCT_CONFIG", str(tmp_path / "run.json"))
        with context or _nothing():
            source_value(knob.name, LAYER_NAME)
    assert where in str(refused.value), str(refused.value)
    assert "must be" in str(refused.value) or "unknown key" in str(refused.value)


def test_unknown_keys_and_knobs_are_errors_naming_them(tmp_path):
    for contents, named in [({"speed": 1}, "run.json: speed: unknown key"),
                            ({"default": {"speed": 1}}, "run.json: default.speed: unknown key"),
                            ({"layers": {"conv1": {"schedule": "streams"}}},
                             "run.json: layers.conv1.schedule: unknown key"),
                            ({"layers": {"conv1": {"partitions": 2}}, "gpu": [0]}, "run.json: gpu: unknown key")]:
        with pytest.raises(ConfigError, match=re.escape(named)):
            settings.parse_config(json.dumps(contents), "run.json")
    with pytest.raises(ConfigError, match="override: speed: unknown knob"):
        with override(speed=1):
            pass


def test_the_file_is_loaded_by_a_call_before_the_variable(tmp_path, monkeypatch):
    named, loaded = tmp_path / "named.json", tmp_path / "loaded.json"
    named.write_text('{"schedule": "streams"}')
    loaded.write_text('{"schedule": "tuned"}')
    monkeypatch.setenv("CCT_CONFIG", str(named))
    assert source_value("schedule") == ("config", "streams")
    with override(config=settings.read_config(loaded)):
        assert source_value("schedule") == ("config", "tuned")
    assert source_value("schedule") == ("config", "streams")


def test_override_restores_what_was_there():
    before = source_value("schedule")
    with override(schedule="streams"):
        with override(schedule="tuned"):
            assert source_value("schedule") == ("call", "tuned")
        assert source_value("schedule") == ("call", "streams")
    assert source_value("schedule") == before


def test_no_module_but_the_table_reads_a_cct_variable():
    """`os.environ`/`getenv` next to a CCT_ name, anywhere in the package."""
    root = Path(settings.__file__).resolve().parents[2]
    readers = []
    for path in [*root.glob("cct/**/*.py"), *root.glob("layers/*.py"), *root.glob("lowering/*.py")]:
        if path.name == "settings.py" and path.parent.name == "core":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(environ|getenv)\b.*(CCT_|_ENV\b)", line):
                readers.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not readers, "\n".join(readers)
