"""A deployed run shows a line per round while it runs (the ServerApp's rounds.csv, polled)."""

from __future__ import annotations

import io

from server.records import RoundRecord
from server.results import write_rounds
from simulations.deploy.fedgc_run import RoundProgress, bytes_table


def test_each_round_is_shown_once_as_the_server_app_writes_it(tmp_path):
    out = io.StringIO()
    watch = RoundProgress(tmp_path, rounds=3, out=out)
    watch()  # no rounds.csv yet: nothing to show, no error
    assert out.getvalue() == ""
    done = [RoundRecord(round=1, accuracy=0.25, uplink_bytes=10, dense_uplink_bytes=1000,
                        clients_sampled=4, clients_aggregated=4),
            RoundRecord(round=2, accuracy=0.5)]  # loss NaN: written empty, read back as NaN
    write_rounds(tmp_path, done)
    watch()
    watch()  # a poll without a new round prints nothing
    write_rounds(tmp_path, [*done, RoundRecord(round=3, accuracy=0.75, loss=0.5)])
    watch()
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert "acc 0.2500" in lines[0] and "(x  100.0)" in lines[0] and "clients 4/4" in lines[0]
    assert "loss nan" in lines[1]
    assert "acc 0.7500  loss 0.5000" in lines[2] and lines[2].rstrip().endswith("ETA 0:00")


def test_the_table_sets_the_bytes_on_the_links_beside_the_payload():
    summary = {"uplink_bytes": 100_000, "downlink_bytes": 2_000_000}
    record = {"links": {"0": {"uplink_bytes": 1_500_000, "downlink_bytes": 1_800_000},
                        "1": {"uplink_bytes": 900_000, "downlink_bytes": 1_400_000}}}
    lines = bytes_table(summary, record).splitlines()
    assert lines[0].split() == ["bytes", "payload", "MB", "on", "the", "links", "MB",
                                "links/payload"]
    assert lines[2].split() == ["uplink", "0.100", "2.400", "24.0x"]
    assert lines[3].split() == ["downlink", "2.000", "3.200", "1.6x"]
    assert lines[4].split() == ["total", "2.100", "5.600", "2.7x"]
    # Without a shaped link nothing counted the wire: said, not shown as zero.
    bare = bytes_table(summary, {"links": {"0": None}}).splitlines()
    assert bare[2].split() == ["uplink", "0.100", "-", "-"] and "--link" in bare[-1]
