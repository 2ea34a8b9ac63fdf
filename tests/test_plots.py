"""Plots read at a glance: titled by methods and scenario, total traffic, plain log ticks,
integer rounds, the target line, legends off the data."""

from __future__ import annotations

import json
import re

import matplotlib.pyplot as plt
import pytest

from server.records import RoundRecord
from server.results import write_rounds
from simulations.netem.report import virtual_time_figure
from simulations.plots import plot_bands, plot_run, readable_log, runs_figure, scenario_title

PNG = b"\x89PNG\r\n\x1a\n"
CONFIG = {"task": "digits", "num_clients": 6, "clients_per_round": 3, "partition": "dirichlet",
          "alpha": 0.5, "density": 0.001, "downlink_density": 1.0}


#: What the emulator's WireColumns add to a round (simulations.netem.wire_columns).
WIRE = {"wire_uplink_bytes": 30_000, "wire_downlink_bytes": 60_000, "joules": 20.0,
        "idle_joules": 5.0}


def _run(tmp_path, method: str, up: int, netem: bool = False, deadline_s: float = 60.0,
         wire: bool = False):
    d = tmp_path / "some" / "nested" / method
    write_rounds(d, [RoundRecord(i, accuracy=0.1 * i, uplink_bytes=up, downlink_bytes=40 * up,
                                 extra={"virtual_seconds": 3.0 * i, "dropped_deadline": 0,
                                        "dropped_link": 0, "dropped_rejected": 0,
                                        **(WIRE if wire else {})}
                                 if netem else {})
                     for i in range(1, 8)])
    summary = {"method": method, "rounds": 7, "config": {**CONFIG, "method": method},
               "density": 1.0 if method in ("dense", "fedavgm") else 0.001}
    if netem:
        summary["netem"] = {"netem.enabled": True, "netem.mix": "3g:1.0",
                            "netem.deadline_s": deadline_s}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def _labels(fig, ax, axis: str) -> list[str]:
    fig.canvas.draw()
    ticks = ax.get_xticklabels() if axis == "x" else ax.get_yticklabels()
    return [t.get_text() for t in ticks if t.get_text()]


@pytest.mark.parametrize("low, high", [(0.026, 0.074), (0.9, 1.3), (0.2, 4100.0)])
def test_log_ticks_are_plain_numbers(low: float, high: float) -> None:
    """A narrow range used to show "1.1x10^0" (mathtext); now plain numbers that parse."""
    fig, ax = plt.subplots()
    ax.plot([low, high], [0, 1])
    readable_log(ax, "x")
    labels = _labels(fig, ax, "x")
    plt.close(fig)
    assert labels and all("$" not in t and "times" not in t for t in labels), labels
    values = [float(t.replace(",", "").replace("\u2212", "-")) for t in labels]
    assert all(low / 10 <= v <= high * 10 for v in values)


def test_a_wide_log_range_is_labelled_by_decades() -> None:
    fig, ax = plt.subplots()
    ax.plot([0.005, 2000.0], [0, 1])
    readable_log(ax, "x")
    labels = _labels(fig, ax, "x")
    plt.close(fig)
    assert labels and all(re.fullmatch(r"0\.0*1|10*", t) for t in labels), labels


def test_bytes_axis_uses_si_prefixes() -> None:
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3_000, 200_000])
    readable_log(ax, "y", unit="B")
    labels = _labels(fig, ax, "y")
    plt.close(fig)
    assert "10 kB" in labels and "100 kB" in labels


def test_run_figure_title_total_traffic_and_rounds(tmp_path) -> None:
    dense, dgc = _run(tmp_path, "dense", 100_000), _run(tmp_path, "dgc", 500)
    fig = runs_figure({"dense": dense, "dgc": dgc})
    title = fig._suptitle.get_text()
    assert title == ("dense vs dgc on digits: 6 clients, 3 per round, Dirichlet(0.5), 7 rounds, "
                     "density 0.001")
    assert "some/nested" not in title
    ax_total, ax_up, ax_bytes = fig.axes
    assert "uplink + downlink" in ax_total.get_xlabel()
    # The total panel's last x is the sum of both directions, not the uplink.
    x_total = ax_total.lines[1].get_xdata()[-1]
    assert x_total == pytest.approx(7 * 41 * 500 / 1e6)
    assert ax_up.lines[1].get_xdata()[-1] == pytest.approx(7 * 500 / 1e6)
    assert len(ax_bytes.lines) == 4  # uplink and downlink of each run
    rounds = _labels(fig, ax_bytes, "x")
    assert all(re.fullmatch(r"\d+", t) for t in rounds), rounds
    # One legend for the runs, under the panels (not on an axes' data).
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["dense", "dgc"]
    fig.canvas.draw()
    box = legend.get_window_extent()
    assert all(box.y1 <= ax.get_window_extent().y0 for ax in fig.axes)
    plt.close(fig)


def test_single_run_plot_is_titled_by_method_not_path(tmp_path) -> None:
    d = _run(tmp_path, "dgc", 500)
    assert plot_run(d).read_bytes()[:8] == PNG
    assert scenario_title([d]).startswith("dgc on digits: ")
    assert scenario_title([tmp_path / "nothing"]) == ""
    bands = plot_bands({"dgc": [d, d]}, tmp_path / "b.png")
    assert bands.read_bytes()[:8] == PNG


def test_netem_report_has_the_target_line_and_the_links(tmp_path) -> None:
    runs = {"dense": _run(tmp_path, "dense", 100_000, netem=True),
            "dgc": _run(tmp_path, "dgc", 500, netem=True)}
    fig = virtual_time_figure(runs, target=0.45)
    ax_acc, ax_energy, ax_dur, _, ax_bytes = fig.axes
    flat = [line for line in ax_acc.lines if list(line.get_ydata()) == [0.45, 0.45]]
    assert len(flat) == 1, "a horizontal line at the target accuracy"
    # Both runs reach 0.5 >= 0.45 in round 5, after 3+6+9+12+15 = 45 virtual seconds: marked.
    marks = [line for line in ax_acc.lines if list(line.get_xdata()) == [45.0, 45.0]]
    assert len(marks) == 2
    assert "links 3g:1.0, deadline 60 s" in fig._suptitle.get_text()
    assert [t.get_text() for t in ax_bytes.get_legend().get_texts()] == \
        ["payload up", "payload down", "payload total"]
    assert all(re.fullmatch(r"\d+", t) for t in _labels(fig, ax_dur, "x"))
    assert not ax_energy.lines  # no joules recorded: the panel says so
    plt.close(fig)


def test_runs_with_wire_bytes_show_them_beside_the_payload_and_energy(tmp_path) -> None:
    """The emulator's link bytes: thin pale lines beside the payload's, bars of their own in the
    netem report, and accuracy against cumulative joules (clients and idle nodes)."""
    runs = {"dense": _run(tmp_path, "dense", 100_000, netem=True, wire=True),
            "dgc": _run(tmp_path, "dgc", 500, netem=True, wire=True)}
    fig = runs_figure(runs, target=0.45)
    ax_total, ax_up, ax_bytes, ax_time, ax_energy = fig.axes
    # Emulated runs: accuracy against virtual time, the target dashed, each run's reaching it.
    assert len([line for line in ax_time.lines if line.get_linestyle() != ":"]) == 2 + 1
    assert "target 0.450" in ax_time.get_title()
    on_wire = [line for line in ax_total.lines if line.get_gid() == "wire"]
    assert len(on_wire) == 2 and on_wire[1].get_xdata()[-1] == pytest.approx(7 * 90_000 / 1e6)
    assert len(ax_bytes.lines) == 6  # payload up and down, wire up, of each run
    assert ax_energy.lines[1].get_xdata()[-1] == pytest.approx(7 * 25.0)
    plt.close(fig)
    fig = virtual_time_figure(runs, target=0.45)
    ax_energy, ax_bytes = fig.axes[1], fig.axes[4]
    assert [t.get_text() for t in ax_bytes.get_legend().get_texts()] == \
        ["payload up", "payload down", "payload total", "wire up", "wire down", "wire total"]
    assert ax_energy.lines[0].get_xdata()[-1] == pytest.approx(7 * 25.0)
    plt.close(fig)


def test_every_method_has_its_own_colour_a_family_shades_of_one_hue() -> None:
    """compare.png drew top-k, STC and DGC in one colour told apart by dash style only: each
    method has a colour of its own, a family shades of one hue, and line styles besides."""
    import colorsys

    from simulations.plots import method_styles

    styles = method_styles(["tcs", "dense", "topk", "fedavgm", "dgc", "stc", "randk",
                            "not_a_method", "pkg.gone:make"])
    # Family by family, in the order of each family's first method.
    assert list(styles) == ["tcs", "randk", "dense", "fedavgm", "topk", "dgc", "stc",
                            "not_a_method", "pkg.gone:make"]
    colours = [tuple(round(c, 3) for c in s["color"]) for s in styles.values()]
    assert len(set(colours)) == len(colours)  # one colour per method
    assert styles["dense"]["color"] == (0.0, 0.0, 0.0)  # the baseline's: black, then greys
    assert len(set(styles["fedavgm"]["color"])) == 1
    for family in (("topk", "dgc", "stc"), ("tcs", "randk")):
        hues = {round(colorsys.rgb_to_hsv(*styles[m]["color"])[0], 3) for m in family}
        assert len(hues) == 1, family  # shades of one hue
        assert len({styles[m]["linestyle"] for m in family}) == len(family)
    hues = {round(colorsys.rgb_to_hsv(*styles[m]["color"])[0], 3)
            for m in ("tcs", "topk", "not_a_method", "pkg.gone:make")}
    assert len(hues) == 4  # unknown methods: families of their own


def test_a_dozen_methods_read_family_by_family_with_the_legend_below_the_data(tmp_path) -> None:
    names = ["dense", "fedavgm", "topk", "stc", "dgc", "randk", "tcs", "qsgd", "signsgd"]
    runs = {m: _run(tmp_path, m, 100 + 10 * i) for i, m in enumerate(names)}
    fig = runs_figure(runs)
    assert fig._suptitle.get_text().startswith("9 methods on digits: ")
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    # A column per family (dense, top-k, shared positions, and qsgd and signsgd alone), padded
    # with blank entries to the largest family's three rows: read down, a column is a family.
    assert labels == ["dense", "fedavgm", "", "topk", "stc", "dgc", "randk", "tcs", "",
                      "qsgd", "", "", "signsgd", "", ""]
    room = fig.legend_room  # what save() keeps for it: three rows need more than one
    assert 0.07 < room < 0.45
    fig.tight_layout(rect=(0, room, 1, 1))
    fig.canvas.draw()
    box = legend.get_window_extent()
    below = min(min(ax.get_window_extent().y0, ax.xaxis.label.get_window_extent().y0)
                for ax in fig.axes)
    assert box.y1 <= below  # under the panels and their axis labels
    plt.close(fig)
    out = plot_bands({m: [d] for m, d in runs.items()}, tmp_path / "bands.png")
    assert out.read_bytes()[:8] == PNG


def test_a_run_without_a_deadline_is_titled_so(tmp_path) -> None:
    # netem.deadline_s = 0 is the default, and means none ("deadline 0 s" read as a bug).
    title = scenario_title([_run(tmp_path, "dgc", 500, netem=True, deadline_s=0.0)])
    assert title.endswith("links 3g:1.0, no deadline") and "deadline 0" not in title
