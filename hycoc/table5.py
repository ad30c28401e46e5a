"""The paper's Table 5 configurations as data: the one list the device runtime, the bench, the load test, the cost
model and the CLI read (torch-free; nothing here imports a package above core).

Each `Configuration` says how one row of Table 5 drafts and verifies:

    name          draft_place   acceptance  chain    passes     what it is (paper Table 5)
    cloud-mtp     cloud-mtp     exact       none     none       the verifier drafts with its MTP head (Cloud+)
    specedge      device        exact       none     specedge   a SpecEdge-style tree of SLM passes on the device
    specedge-eps  device        epsilon     none     specedge   the same under epsilon-threshold acceptance
    hyco          device        epsilon     device   slm        HyCo: MTP chain + one SLM expansion pass
    hyco-2p       device        epsilon     device   two        HyCo-2P: two SLM passes
    hyco-exact    device        exact       device   slm        HyCo under exact acceptance
    server-head   server-head   exact       server   slm        the MTP head on the verifier, the SLM on the device
    slm-alone     (none)        (none)      none     slm        the SLM alone, no verifier

draft_place: the OPEN's ``draft_place`` (`hycoc.protocol.messages.DRAFT_PLACES`), None for no server.
acceptance: "exact" / "epsilon" (the OPEN's acceptance), None without a verifier. chain: who runs the MTP chain
("device": the MTP Drafter, "server": the reply's chain, "none"). passes: the device's SLM passes per round ("slm":
the recipe's round.slm_passes, "two", "specedge": round.specedge_passes, "none").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Configuration:
    """One configuration of Table 5 (module docstring for the fields' values)."""

    name: str
    draft_place: str | None
    acceptance: str | None
    chain: str
    passes: str

    @property
    def verifier(self) -> bool:
        """Whether a verifier takes part (every configuration but slm-alone)."""
        return self.draft_place is not None


#: Every configuration, in the order of the paper's Table 5 (the order of the bench's tables).
CONFIGURATIONS: tuple[Configuration, ...] = (
    Configuration("cloud-mtp", "cloud-mtp", "exact", "none", "none"),
    Configuration("specedge", "device", "exact", "none", "specedge"),
    Configuration("specedge-eps", "device", "epsilon", "none", "specedge"),
    Configuration("hyco", "device", "epsilon", "device", "slm"),
    Configuration("hyco-2p", "device", "epsilon", "device", "two"),
    Configuration("hyco-exact", "device", "exact", "device", "slm"),
    Configuration("server-head", "server-head", "exact", "server", "slm"),
    Configuration("slm-alone", None, None, "none", "slm"),
)
#: name -> `Configuration`, in Table 5 order.
BY_NAME: dict[str, Configuration] = {c.name: c for c in CONFIGURATIONS}
#: The names in Table 5 order.
TABLE5_ORDER: tuple[str, ...] = tuple(BY_NAME)
#: Configurations without a verifier: no g, no forwards, no bytes.
NO_VERIFIER: frozenset[str] = frozenset(c.name for c in CONFIGURATIONS if not c.verifier)
#: Configurations with a verifier in every round (what `hycoc loadtest` can record and replay).
WITH_VERIFIER: tuple[str, ...] = tuple(c.name for c in CONFIGURATIONS if c.verifier)
#: Configurations `hycoc run --mode` offers: those the device drafts for (not cloud-mtp, whose drafts are the
#: verifier's), without specedge-eps (`hycoc bench` and `hycoc tune-epsilon` run it).
RUN_MODES: tuple[str, ...] = ("hyco", "hyco-exact", "hyco-2p", "specedge", "server-head", "slm-alone")


def configuration(name: str) -> Configuration:
    """The `Configuration` called ``name``. Raises ValueError naming the allowed names for another."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown configuration {name!r}; choose one of {', '.join(TABLE5_ORDER)}") from None


__all__ = [
    "BY_NAME",
    "CONFIGURATIONS",
    "NO_VERIFIER",
    "RUN_MODES",
    "TABLE5_ORDER",
    "WITH_VERIFIER",
    "Configuration",
    "configuration",
]
