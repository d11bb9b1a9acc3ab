"""The pure parts of the cuDNN search past the heuristics (fluxpy.kernels.cudnn.search) and of the disk table
(fluxpy.kernels.cudnn.diskcache): no GPU needed."""
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from fluxpy.kernels.cudnn import diskcache
from fluxpy.kernels.cudnn.search import KNOB_NAMES, Config, knob_values


@settings(max_examples=200, deadline=None)
@given(st.integers(-5, 50), st.integers(0, 5000), st.integers(1, 9), st.integers(2, 10))
def test_knob_values_stay_in_range_on_the_stride(lo, span, stride, most):
    hi = lo + span
    values = knob_values(lo, hi, stride, most)
    assert values == sorted(set(values))                      # increasing, no repeats
    assert 1 <= len(values) <= most
    assert values[0] == lo
    assert all(lo <= v <= hi and (v - lo) % stride == 0 for v in values)
    n = span // stride + 1
    if n <= most:
        assert len(values) == n                               # small ranges: every value
    else:
        assert values[-1] == lo + (n - 1) * stride            # large ones keep both ends


def test_knob_values_of_an_empty_range():
    assert knob_values(3, 2, 1) == []


def test_config_round_trips_through_json_and_names_its_knobs():
    c = Config(5).with_knob(17, 4).with_knob(2, 7).with_knob(17, 8)   # a later value replaces the earlier
    assert c == Config(5, ((2, 7), (17, 8)))
    assert Config.from_json(json.loads(json.dumps(c.to_json()))) == c
    assert str(c) == "engine 5 [TILE_SIZE=7, SPLIT_K_SLC=8]"
    assert str(Config(3)) == "engine 3"
    assert KNOB_NAMES[17] == "SPLIT_K_SLC" and KNOB_NAMES[45] == "OUTPUT_TMA_ENABLE"


def test_disk_table_merges_rows_written_by_another_process(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    monkeypatch.setattr(diskcache.DiskTable, "path", lambda self: str(path))
    a, b = diskcache.DiskTable("t"), diskcache.DiskTable("t")
    a.put("k1", [1])
    b.put("k2", {"x": 2})                  # b read the file after a wrote it
    a.put("k3", 3)                         # a merges b's row instead of dropping it
    assert json.loads(path.read_text()) == {"k1": [1], "k2": {"x": 2}, "k3": 3}
    fresh = diskcache.DiskTable("t")
    assert fresh.get("k2") == {"x": 2} and fresh.get("nope") is None
    fresh.forget(disk=True)
    assert not path.exists() and diskcache.DiskTable("t").get("k1") is None


def test_disk_table_ignores_a_corrupt_file(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    path.write_text("{not json")
    monkeypatch.setattr(diskcache.DiskTable, "path", lambda self: str(path))
    t = diskcache.DiskTable("t")
    assert t.get("k") is None
    t.put("k", 1)
    assert json.loads(path.read_text()) == {"k": 1}
