"""`hycoc.table5` is the one list of the paper's Table 5 configurations: its values agree with the wire protocol's
enums and the paper's table, and every list the packages keep is derived from it (the same object, or computed
from it), so a list typed again by hand fails here."""

from __future__ import annotations

from hycoc import table5
from hycoc.protocol.messages import ACCEPTANCE_MODES, DRAFT_PLACES


def test_each_configuration_speaks_the_wire_protocols_values():
    for c in table5.CONFIGURATIONS:
        assert c.draft_place is None or c.draft_place in DRAFT_PLACES, c
        assert c.acceptance is None or c.acceptance in ACCEPTANCE_MODES, c
        assert (c.draft_place is None) == (c.acceptance is None), c
        assert c.chain in ("device", "server", "none") and c.passes in ("slm", "two", "specedge", "none"), c
    assert set(table5.RUN_MODES) <= set(table5.BY_NAME)


def test_the_settings_are_paper_table_5s():
    """Paper Table 5 (shared/hyco-paper.txt): Cloud+ drafts on the server with its MTP head (K = 4, no SLM);
    SpecEdge-style has no chain and 4 SLM passes; HyCo has the chain and 1 SLM pass, -2P two; epsilon for HyCo,
    -2P and SpecEdge-epsilon, exact for the rest; server head keeps the chain on the server, one SLM pass."""
    by = table5.BY_NAME
    assert (by["cloud-mtp"].draft_place, by["cloud-mtp"].passes) == ("cloud-mtp", "none")
    assert [by[n].acceptance for n in ("hyco", "hyco-2p", "specedge-eps")] == ["epsilon"] * 3
    assert [by[n].acceptance for n in ("cloud-mtp", "specedge", "hyco-exact", "server-head")] == ["exact"] * 4
    assert [by[n].chain for n in ("hyco", "hyco-2p", "hyco-exact", "server-head")] == ["device"] * 3 + ["server"]
    assert by["hyco-2p"].passes == "two" and by["specedge"].passes == by["specedge-eps"].passes == "specedge"
    assert table5.NO_VERIFIER == {"slm-alone"}
    assert table5.TABLE5_ORDER[:3] == ("cloud-mtp", "specedge", "specedge-eps")


def test_every_list_of_configurations_is_derived_from_the_one_table():
    from hycoc.runtime import client

    from hycoc.bench.cost_model import model as cost_model
    from hycoc.bench.paper import runner, stats, summary
    from hycoc.cli import bench as cli_bench
    from hycoc.cli._common import RunMode

    assert client.MODES is table5.BY_NAME and client.Mode is table5.Configuration
    assert client.RUN_MODES is table5.RUN_MODES
    assert stats.TABLE5_ORDER is table5.TABLE5_ORDER and summary.NO_VERIFIER is table5.NO_VERIFIER
    assert runner.CONFIGS is table5.TABLE5_ORDER and cli_bench.BENCH_CONFIGS is table5.TABLE5_ORDER
    assert cli_bench.LOADTEST_CONFIGS is table5.WITH_VERIFIER
    assert cost_model.DRAFT_PLACE_OF == {c.name: c.draft_place for c in table5.CONFIGURATIONS if c.verifier}
    assert tuple(m.value for m in RunMode) == table5.RUN_MODES
