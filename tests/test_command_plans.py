"""The plans `hycoc loadtest` and `hycoc capacity` check their options into (`hycoc.bench.loadtest.app.plan_loadtest`,
`hycoc.bench.capacity.options.plan_capacity`): what each accepts, what it derives, and the one line it refuses with.
Parsing only (the toy recipe is read, no model loaded): well under a second."""

from __future__ import annotations

from pathlib import Path

import pytest
from paths import ROOT

from hycoc.bench.capacity.options import plan_capacity
from hycoc.bench.capacity.requests import CapacityError
from hycoc.bench.capacity.run import CONFIGS, PROJECTION_CONFIGS
from hycoc.bench.inputs import OptionError
from hycoc.bench.loadtest.app import check_configs, parse_counts, plan_loadtest
from hycoc.recipe import load_recipe

TOY, GEMMA4 = ROOT / "recipes" / "toy.toml", ROOT / "recipes" / "gemma4.toml"


def test_counts_are_positive_integers_and_a_bad_list_is_named_with_its_option():
    assert parse_counts("1,4,16,64", "--sessions") == [1, 4, 16, 64]
    assert parse_counts("7", "--devices") == [7]
    for bad in ("0", "1,0", "1,,4", "a", "", "-2"):
        with pytest.raises(OptionError) as e:
            parse_counts(bad, "--devices")
        assert str(e.value) == f"--devices {bad!r}: give comma-separated positive integers such as 1,4,16,64"


def test_configs_keep_their_order_and_the_unknown_ones_are_named():
    assert check_configs(["hyco", "cloud-mtp"], ("cloud-mtp", "hyco")) == ["hyco", "cloud-mtp"]  # as given
    with pytest.raises(OptionError, match=r"^--configs: unknown or without a verifier: fast, slm; allowed: a, b$"):
        check_configs(["a", "fast", "slm"], ("a", "b"))


def loadtest_plan(**given):
    args = {"sessions": "1,4", "configs": "hyco", "batching": None, "server": None, "duration_s": 2.0}
    return plan_loadtest(out=Path("out"), **(args | given))


def test_a_loadtest_records_its_configs_then_each_mode_config_it_lacks():
    # --configs hyco,specedge and --batching batched,serial:cloud-mtp,budgeted:hyco: the devices of serial replay
    # cloud-mtp alone, budgeted's hyco alone; recorded: hyco, specedge (the --configs), then cloud-mtp (hyco is
    # recorded already) = [hyco, specedge, cloud-mtp]
    plan = loadtest_plan(configs="hyco,specedge", batching="batched,serial:cloud-mtp,budgeted:hyco")
    assert plan.recorded == ["hyco", "specedge", "cloud-mtp"]
    assert plan.configs == ["hyco", "specedge"] and plan.sessions == [1, 4]
    assert plan.modes == ["batched", "serial:cloud-mtp", "budgeted:hyco"]
    assert loadtest_plan().modes is None and loadtest_plan().recorded == ["hyco"]  # no --batching: the default


@pytest.mark.parametrize(
    "given, message",
    [
        ({"sessions": "0", "configs": "fast"}, "--sessions '0': give comma-separated"),  # sessions are checked first
        ({"configs": "slm-alone"}, "--configs: unknown or without a verifier: slm-alone;"),
        ({"batching": "batched:fast"}, "--batching 'batched:fast': allowed: serial, batched, budgeted, allowance"),
        ({"batching": "fast"}, "--batching 'fast': allowed:"),
        ({"batching": "serial,batched", "server": "ws://h:1"}, "--batching 'serial,batched' with --server: a running"),
        ({"server": "http://h:1"}, "--server 'http://h:1': expected ws://HOST:PORT"),
    ],
)
def test_a_loadtest_plan_refuses_a_bad_command_line_in_one_line(given, message):
    with pytest.raises(OptionError) as e:
        loadtest_plan(**given)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def capacity_plan(recipe: Path, **given):
    args = {
        "configs": None,
        "batching": None,
        "devices": "1,4",
        "link": "none",
        "gpu": "rtx-pro-6000",
        "allowance_sweep": None,
        "validate_sessions": "1,4,16,64",
        "validate_modes": "serial,batched,budgeted",
        "cost_model": None,
        "validate": False,
    }
    passed = {"target_p90_ms": 60.0, "duration_s": 30.0, "replicas": 1, "device_scale": 1.0, "out": Path("out")}
    passed |= {"validate_duration_s": 25.0, "validate_only": False, "prompts": 4, "bundle": None, "trace": None}
    return plan_capacity(load_recipe(recipe), recipe, **(args | given), **passed, remeasure=False)


def test_the_capacity_defaults_follow_where_the_verifier_is():
    toy = capacity_plan(TOY)  # its verifier is in the repository: the simulation of this machine's verifier
    assert toy.local and toy.modes == ["serial", "batched", "budgeted"] and toy.configs == list(CONFIGS)
    gemma = capacity_plan(GEMMA4)  # a hub model: the real-shape projection, whose devices redraft to an allowance
    assert not gemma.local and gemma.modes == ["batched", "budgeted", "allowance"]
    assert gemma.configs == list(PROJECTION_CONFIGS)
    # 5,9 rows: the sweep of the projection; 1 and 4 sessions of the check: as tuples
    swept = capacity_plan(GEMMA4, allowance_sweep="5,9", validate_sessions="1,4")
    assert swept.sweep_rows == (5, 9) and swept.validate_sessions == (1, 4) and swept.counts == [1, 4]


@pytest.mark.parametrize(
    "recipe, given, message",
    [
        (TOY, {"batching": "allowance"}, "--batching allowance: "),  # recorded trees cannot be redrafted
        (TOY, {"allowance_sweep": "5"}, "--allowance-sweep: the projection's check"),
        (GEMMA4, {"validate": True}, "--validate runs hycoc loadtest on this machine"),
        (TOY, {"gpu": "a100"}, "--gpu 'a100': allowed: rtx-pro-6000"),
        (TOY, {"validate_modes": "allowance"}, "--validate-modes 'allowance': allowed: serial, batched, budgeted"),
        (TOY, {"link": "fast"}, "--link: "),
    ],
)
def test_a_capacity_plan_refuses_a_bad_command_line(recipe, given, message):
    with pytest.raises(OptionError, match="^" + message.replace("(", r"\(")):
        capacity_plan(recipe, **given)


def test_a_missing_cost_model_file_is_not_a_usage_error(tmp_path):
    """Exit 1, not 2 (docs/commands.md "Exit codes"): the command line is fine, the file it names is not there."""
    with pytest.raises(CapacityError, match="--cost-model .*: no such file"):
        capacity_plan(TOY, cost_model=tmp_path / "nope.json")
