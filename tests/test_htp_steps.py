"""The HTP target's pure steps (`hycoc.targets.htp`): the graph names a compile takes and the binary's target it
accepts, worked by hand; tests/test_htp_target.py compiles real graphs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from hycoc.targets.htp import binary_target_matches, check_graph_names
from hycoc.targets.profiles import get_profile


def test_graph_names_must_be_unique_file_names():
    check_graph_names(["head", "slm.s0", "slm_decode"], [Path("a"), Path("b"), Path("c")], share=True)
    with pytest.raises(ValueError, match="unique"):
        check_graph_names(["slm", "slm"], [Path("a"), Path("b")], share=False)
    with pytest.raises(ValueError, match=r"\[A-Za-z0-9_.-\]\+"):
        check_graph_names(["head/1"], [Path("a")], share=False)  # "/" would put the context in another folder


def test_one_model_twice_is_refused_only_in_a_shared_context():
    check_graph_names(["a", "b"], [Path("m"), Path("m")], share=False)
    with pytest.raises(ValueError, match="7003"):
        check_graph_names(["a", "b"], [Path("m"), Path("m")], share=True)


def test_the_binary_must_record_the_profiles_arch_and_soc():
    v81 = get_profile("htp-v81")
    assert v81.soc_id is not None  # the SoC is compared too
    same = SimpleNamespace(arch=v81.htp_arch, soc_type=v81.soc_model.lower())  # case does not matter
    assert binary_target_matches(same, v81)
    # QNN compiles for a generic v68 when it does not know the arch: refused
    assert not binary_target_matches(SimpleNamespace(arch=68, soc_type=v81.soc_model), v81)
    assert not binary_target_matches(SimpleNamespace(arch=v81.htp_arch, soc_type="SM0000"), v81)
    assert not binary_target_matches(None, v81)  # nothing readable in the binary
