"""The registry: docs/methods.md's table is the registry's, every method answers the contract,
and no product code outside fedgc/methods compares method names."""

from __future__ import annotations

import re
from pathlib import Path

from fedgc import methods
from fedgc.schema import per_method_keys
from fedgc.settings import RunConfig, ServerSettings, TrainSettings
from simulations.cli import main, methods_table

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_methods_table_is_the_registrys(capsys):
    doc = (ROOT / "docs" / "methods.md").read_text().splitlines()
    start = doc.index("<!-- generated: python -m simulations methods -->")
    end = doc.index("<!-- end of generated table -->")
    assert doc[start + 1:end] == methods_table(), \
        "docs/methods.md's table differs: paste `python -m simulations methods` there"
    assert main(["methods"]) == 0
    assert capsys.readouterr().out.splitlines() == methods_table()


def test_each_method_gives_the_whole_contract():
    for m in methods.registered():
        config = RunConfig.from_flat({"method": m.name, "run_name": "x"})
        assert m.name and m.description and config.method.name == m.name
        assert m.codec(config.train).kind
        assert 0 < m.downlink(config).density <= 1
        phone = methods.phone_export_of(config.method)
        assert (phone is not None) == m.phone
        assert phone is None or phone.phone_config(config.train).density == \
            m.uplink_density(config.train)
        own = [] if m.settings is None else per_method_keys(m.settings)
        assert set(m.defaults) <= set(per_method_keys(TrainSettings)
                                      + per_method_keys(ServerSettings) + own)
    assert methods.baseline() == "dense"
    assert set(methods.compared()) == {"dense", "fedavgm", "topk", "stc", "dgc"}


def test_no_product_code_outside_the_registry_compares_method_names():
    """What issue 29 removed (19 comparisons in 8 files and four capability tuples) stays
    removed: method behaviour is asked of the Method. (A line that compares with a method's
    name and speaks of a method: ``kind == "dense"`` is a downlink kind.)"""
    names = "|".join(methods.names())
    compare = re.compile(rf"""(==|!=|\bin)\s*\(?\s*["']({names})["']|["']({names})["']\s*(==|!=)"""
                         r"|(DENSE|RESIDUAL|SERVER_MOMENTUM|PHONE)_METHODS")
    found = []
    for folder in ("server", "client", "fedgc", "android_bridge", "simulations", "dgc", "tasks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.parent.name == "methods" and path.parent.parent.name == "fedgc":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if compare.search(line) and "method" in line.lower():
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_compare_methods_all_is_every_registered_method_listed_family_by_family():
    import pytest

    from fedgc.methods import Method, register
    from fedgc.settings import SettingsError
    from simulations.cli import check_methods
    from simulations.compare import by_family

    assert check_methods(["all"], "--methods") == list(methods.names())
    with pytest.raises(SettingsError, match="twice"):
        check_methods(["all", "dgc"], "--methods")

    class All(Method):
        name = "all"

    with pytest.raises(ValueError, match="'all' stands for every method"):
        register(All())
    # The demo's five keep their order; interleaved families are brought together, each in
    # the order of its first method; a name this process does not know is a family of its own.
    assert by_family(list(methods.compared())) == list(methods.compared())
    assert by_family(["tcs", "dense", "topk", "randk", "gone", "fedavgm", "dgc"]) == \
        ["tcs", "randk", "dense", "fedavgm", "topk", "dgc", "gone"]
    assert all(isinstance(m.family, str) for m in methods.registered())
