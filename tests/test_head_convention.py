"""The MTP head is fed as the checkpoint expects: hycoc's drafts equal transformers' own assisted generation.

The reference is transformers 5.24's ``generate(..., assistant_model=Gemma4AssistantForCausalLM)``, greedy, which
drafts with ``SinglePositionMultiTokenCandidateGenerator``: the assistant reads [e(root); hidden_states[-1] of the
last committed position] (``hidden_states[-1]`` is tied to the POST-norm ``last_hidden_state``) at a constant query
position = the root's position t (offset 0), attends to the verifier's shared KV of the last sliding and last full
layer through its own masks (full: every key; sliding: the last sliding_window + 1 keys) and applies no
final-logit soft-cap. Its candidates are captured per round (a spy on ``get_candidates``) and compared with the
chains hycoc proposes for the same root position t:

* ``cloud-mtp``: the engine's own K-chain (`hycoc.verifier.baselines.draft_cloud_chain`);
* ``server-head``: the engine's server chain (`hycoc.verifier.baselines.draft_server_chain`, full vocabulary);
* ``device``: the float head graph (`hycoc.passes.head.graph.HeadGraph`) run by the device's MTP Drafter
  (`hycoc.runtime.mtp_drafter.MtpDrafter`) from the engine's hand-offs.

Models: tiny random ``Gemma4ForCausalLM`` + ``Gemma4AssistantForCausalLM`` (tests/tiny_models.py), final-logit
soft-cap 30 on the verifier only, in two shapes (`SHAPES`): the gemma4 recipe's (the verifier's sliding window, the
head's and the hand-off window W equal, 1,024 each there) and a head whose sliding window is below W. Every
context stays inside the verifier's sliding window and W: there transformers' slicing of the shared KV is exact
(past the verifier's sliding window it hands the assistant the sliding cache's rows unaligned) and the device ring
holds every committed position (past W the W-window is HyCo's design, Alg. 2, not a convention).

One difference is transformers', not a convention: after a rejection it slices the shared KV to
``input_ids.shape[1]`` rows, one more than the committed positions, so the assistant also reads the KV row the
verifier computed for the REJECTED candidate at the root's position t (a row the verifier never commits; after
prefill and after a fully accepted round the slice is exactly the committed rows). The spy therefore hands
transformers' generator the committed rows only (`committed_kv`); rounds where transformers needed no such cut are
compared with an unmodified run too.

The hand-off is int8 on the wire and the E table 8-bit; the device comparison runs the hand-off unrounded (scale 1,
`float_handoff`) and E in float so that only the convention is tested.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import hycoc.verifier.engine as engine_mod
import numpy as np
import pytest
import torch
from hycoc.passes.head.graph import INPUT_NAMES, HeadGraph, rotary_tables
from hycoc.passes.head.quantize import restrict_output_layer
from hycoc.runtime.mtp_drafter import MtpDrafter
from hycoc.verifier import VerifierEngine
from tiny_models import greedy_session, tiny_head, tiny_verifier
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

from hycoc.host import head_sliding_positions
from hycoc.mtp import FULL, SLIDING
from hycoc.recipe import load_recipe

torch.set_num_threads(1)
RECIPES = Path(__file__).resolve().parents[1] / "recipes"
GEMMA4 = load_recipe(RECIPES / "gemma4.toml")
VOCAB = 512
K = GEMMA4.tree.chain_length
NEW = 22  # tokens generated per prompt; prompt + NEW < each shape's verifier sliding window and W
PROMPTS = [
    np.random.default_rng(seed).integers(3, VOCAB, n).tolist() for seed, n in ((0, 6), (1, 9), (2, 12), (3, 7), (4, 15))
]
EOS = 1
#: (verifier sliding window, head sliding window, W). "gemma4": all equal, as recipes/gemma4.toml (1,024 each with the
#: assumed head config); "narrow-head": a head whose sliding window is below W, where the positions its sliding
#: layer reads (`hycoc.host.head_sliding_positions`) decide the drafts once t > 8.
SHAPES = {"gemma4": (40, 40, 40), "narrow-head": (64, 8, 40)}
RECIPE = (GEMMA4.handoff.hidden, GEMMA4.window.head_query_position_offset, GEMMA4.window.head_sliding_window_inclusive)


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request):
    """(models, W, transformers' reference rounds per prompt) for one of `SHAPES`."""
    verifier_sw, head_sw, window = SHAPES[request.param]
    verifier = tiny_verifier(vocab_size=VOCAB, sliding_window=verifier_sw)
    head = tiny_head(verifier, sliding_window=head_sw)
    head.generation_config.num_assistant_tokens = K
    assert head.config.get_text_config().final_logit_softcapping is None
    assert verifier.config.final_logit_softcapping == 30.0
    assert max(map(len, PROMPTS)) + NEW < min(verifier_sw, window)
    reference = [transformers_rounds(verifier, head, prompt) for prompt in PROMPTS]
    return SimpleNamespace(name=request.param, models=(verifier, head), window=window, reference=reference)


@pytest.fixture(scope="module")
def models():
    """The gemma4-shaped pair alone."""
    verifier_sw, head_sw, _ = SHAPES["gemma4"]
    verifier = tiny_verifier(vocab_size=VOCAB, sliding_window=verifier_sw)
    head = tiny_head(verifier, sliding_window=head_sw)
    head.generation_config.num_assistant_tokens = K
    return verifier, head


def committed_kv(model_outputs, input_ids) -> bool:
    """Cut the shared KV to the committed positions [0, t), t = input_ids.shape[1] - 1 (module docstring); True
    when rows had to be cut (transformers' own slice would have kept the rejected candidate's row at t)."""
    t = input_ids.shape[1] - 1
    kv = model_outputs.shared_kv_states
    extra = kv[FULL][0].shape[-2] - t  # the full layer holds positions from 0
    if extra <= 0:
        return False
    model_outputs.shared_kv_states = {kind: (k[..., :-extra, :], v[..., :-extra, :]) for kind, (k, v) in kv.items()}
    return True


def transformers_rounds(verifier, head, prompt, *, cut: bool = True):
    """Greedy assisted generation by transformers: ({root position t: drafted tokens}, output ids, {t: whether
    the committed-KV cut changed the generator's input})."""
    real = SinglePositionMultiTokenCandidateGenerator.get_candidates
    rounds, cuts = {}, {}

    def spy(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw):
        t = input_ids.shape[1] - 1
        if not is_first_iteration:
            cuts[t] = committed_kv(model_outputs, input_ids) if cut else False
        ids, logits = real(self, input_ids, model_kwargs, model_outputs, is_first_iteration, n_last_matches, **kw)
        if not is_first_iteration:
            rounds[t] = ids[0, input_ids.shape[1] :].tolist()
        return ids, logits

    SinglePositionMultiTokenCandidateGenerator.get_candidates = spy
    try:
        with torch.inference_mode():
            out = verifier.generate(
                torch.tensor([prompt]),
                assistant_model=head,
                do_sample=False,
                max_new_tokens=NEW,
                eos_token_id=EOS,
                pad_token_id=0,
            )
    finally:
        SinglePositionMultiTokenCandidateGenerator.get_candidates = real
    return rounds, out[0, len(prompt) :].tolist(), cuts


def make_engine(verifier, head, window, convention):
    hidden, offset, inclusive = convention
    return VerifierEngine(
        verifier,
        head=head,
        keep_set=None,
        head_window=window,
        chain_length=K,
        handoff_scales=(1.0,) * 6,
        hidden=hidden,
        head_query_position_offset=offset,
        head_sliding_window_inclusive=inclusive,
        eos_token_ids={EOS},
    )


def server_rounds(engine, prompt, place, monkeypatch):
    """hycoc's chains per root position for ``cloud-mtp`` or ``server-head``, and the output ids.

    cloud-mtp drafts from the session's root, which is the prompt's last token; transformers' first draft roots at
    its first generated token, so the engine's request is prompt + that token (``prompt`` here). server-head returns
    the chain for the next root with each reply; its first round verifies the root alone."""
    rounds = {}
    real = engine_mod.draft_cloud_chain

    def spy(model, head, start, k, offset):
        chain = real(model, head, start, k, offset)
        rounds[start.t] = chain
        return chain

    monkeypatch.setattr(engine_mod, "draft_cloud_chain", spy)
    session = greedy_session(engine, prompt, place, NEW - (place == "cloud-mtp"))
    session.prefill()
    chain, seq = [], 0
    while not session.finished:
        reply = session.verify([session.root, *chain], list(range(-1, len(chain))), seq)
        seq += 1
        if place == "server-head" and not reply.finished:
            chain = reply.chain.tolist()
            rounds[session.t] = chain
    return rounds, session.output


class TorchRunner:
    """The head graph as the device runs it (`hycoc.runtime.graphs.GraphRunner`'s run/shape), in torch float32."""

    def __init__(self, graph: HeadGraph, shapes: dict[str, tuple]):
        self.graph, self.shapes = graph, shapes

    def shape(self, name):
        return self.shapes[name]

    @torch.inference_mode()
    def run(self, feeds):
        # the graph's inputs by name, in the order the export binds them (INPUT_NAMES), as the device feeds them
        logits, h_next = self.graph(
            *(torch.as_tensor(np.ascontiguousarray(feeds[n]), dtype=torch.float32) for n in INPUT_NAMES)
        )
        return {"logits": logits.numpy(), "h_next": h_next.numpy()}


def device_drafter(verifier, engine, head, convention):
    """An MTP Drafter over the float head graph with the full vocabulary as keep set (so its arg-max is the
    head's), the engine's producer layers' KV shapes, a W-column ring and the bundle's head sliding positions as
    `hycoc.passes.bundle_write.host_info` writes them."""
    _, offset, inclusive = convention
    W = engine.head_window
    keep = np.arange(VOCAB)
    graph = HeadGraph(restrict_output_layer(head, keep))
    vc, a = verifier.config, verifier.model.layers
    shapes = {"x_hat": (1, 1, 2 * vc.hidden_size)}
    for kind, short in ((SLIDING, "sliding"), (FULL, "full")):
        attn = a[engine.layers[kind]].self_attn
        shapes[f"k_{short}"] = shapes[f"v_{short}"] = (1, attn.k_proj.out_features // attn.head_dim, W, attn.head_dim)
    with torch.no_grad():
        table = verifier.model.embed_tokens(torch.as_tensor(keep)).float().numpy()  # E in float (module docstring)
    bundle = SimpleNamespace(
        round=SimpleNamespace(
            chain_length=K, sibling_depth=GEMMA4.tree.sibling_depth, head_window=W, head_query_position_offset=offset
        ),
        host=SimpleNamespace(
            head=SimpleNamespace(
                sliding_window=head_sliding_positions(head.config.get_text_config().sliding_window, inclusive)
            )
        ),
        keep_set=keep,
        head_rotary=rotary_tables(head.config),
        embed_keep=lambda i: table[i],
    )
    return MtpDrafter(TorchRunner(graph, shapes), bundle)


def float_handoff(monkeypatch):
    """The engine's hand-off without rounding: `quantize_int8` returns x / scale as float32 (the drafter's
    `_Dequantized` takes float rows); with scales 1 the device reads the verifier's values exactly."""
    import hycoc.verifier.kv_surgery as kv_surgery  # pack_handoff's home

    monkeypatch.setattr(kv_surgery, "quantize_int8", lambda x, scale: (x.float() / scale).cpu().numpy())


def device_rounds(engine, drafter, prompt):
    """The device path: round 1 verifies the root alone (no hand-off yet); then each round ingests the reply's
    hand-off and sends root + the MTP chain. Returns ({t: chain}, output ids)."""
    session = greedy_session(engine, prompt, "device", NEW)
    session.prefill()
    rounds, chain, seq = {}, [], 0
    while not session.finished:
        reply = session.verify([session.root, *chain], list(range(-1, len(chain))), seq)
        seq += 1
        if not reply.finished:
            drafter.ingest(reply.handoff)
            chain = drafter.draft().chain
            rounds[session.t] = chain
    return rounds, session.output


def compare(ours: dict, theirs: dict) -> tuple[int, int]:
    """(rounds compared, rounds equal): every root position both drafted from; transformers drafts fewer tokens
    near max_length, so its chain is compared with the same-length prefix of ours."""
    common = sorted(set(ours) & set(theirs))
    return len(common), sum(ours[t][: len(theirs[t])] == theirs[t] for t in common)


def all_paths(shaped, convention, monkeypatch):
    """{path: (rounds compared, rounds equal)} over `PROMPTS` for one convention (hidden, query offset, inclusive
    sliding window); the outputs must equal transformers' (greedy: the verifier alone decides them)."""
    verifier, head = shaped.models
    totals = {p: [0, 0] for p in ("cloud-mtp", "server-head", "device")}
    float_handoff(monkeypatch)
    engine = make_engine(verifier, head, shaped.window, convention)
    drafter = device_drafter(verifier, engine, head, convention)
    for prompt, (theirs, output, _) in zip(PROMPTS, shaped.reference):
        for place in ("cloud-mtp", "server-head", "device"):
            if place == "device":
                ours, out = device_rounds(engine, drafter, prompt)
            else:
                request = prompt + output[:1] if place == "cloud-mtp" else prompt
                ours, out = server_rounds(engine, request, place, monkeypatch)
                out = output[:1] + out if place == "cloud-mtp" else out
            assert out == output, f"{place}: greedy output differs from transformers' for prompt {prompt}"
            n, same = compare(ours, theirs)
            totals[place][0] += n
            totals[place][1] += same
    engine.close()
    return {p: tuple(v) for p, v in totals.items()}


def test_the_gemma4_recipe_drafts_what_transformers_drafts(shaped, monkeypatch):
    result = all_paths(shaped, RECIPE, monkeypatch)
    print(f"{shaped.name}, gemma4 recipe {RECIPE}: {result}")
    for place, (n, same) in result.items():
        assert n >= 5 * len(PROMPTS), f"{place}: only {n} rounds compared"
        assert same == n, f"{place}: {n - same} of {n} rounds draft other tokens than transformers"


#: The old gemma4 defaults (the paper's pre-norm h at t - 1, the sliding layer over its window) and each setting
#: alone: (shape, convention, the paths that must disagree with transformers somewhere).
OTHERS = [
    ("gemma4", ("pre_norm", -1, False), ("cloud-mtp", "server-head", "device")),
    ("gemma4", ("pre_norm", 0, True), ("cloud-mtp", "server-head", "device")),
    ("gemma4", ("post_norm", -1, True), ("cloud-mtp", "server-head", "device")),
    # cloud-mtp runs the head's own transformers masks: only the head graph's ring and the server chain move
    ("narrow-head", ("post_norm", 0, False), ("server-head", "device")),
]


@pytest.mark.parametrize(
    "shaped, convention, differ", OTHERS, indirect=["shaped"], ids=["old-defaults", "pre_norm", "t-1", "sliding-window"]
)
def test_other_conventions_draft_other_tokens(shaped, monkeypatch, convention, differ):
    """The comparison can fail: every other convention proposes other drafts than transformers."""
    result = all_paths(shaped, convention, monkeypatch)
    print(f"{shaped.name}, {convention}: {result}")
    for place, (n, same) in result.items():
        if place in differ:
            assert n > 0 and same < n, f"{place}: {convention} agrees with transformers in all {n} rounds"
        else:
            assert same == n


def test_unmodified_transformers_agrees_where_it_reads_only_committed_rows(shaped):
    """transformers' generator without the committed-KV cut: every round it drafts from committed rows only
    (after prefill or a fully accepted round) proposes what the cut run proposes at that root position; rounds that
    read the rejected candidate's row are the only ones that may differ."""
    verifier, head = shaped.models
    clean = cut_rounds = moved = 0
    for prompt, (ref, output, cuts) in zip(PROMPTS, shaped.reference):
        raw, raw_output, _ = transformers_rounds(verifier, head, prompt, cut=False)
        assert raw_output == output
        for t, chain in raw.items():
            same = t in ref and chain[: len(ref[t])] == ref[t][: len(chain)]
            if t in ref and not cuts[t]:
                clean += 1
                assert same
            elif t in ref:
                cut_rounds += 1
                moved += not same
    print(
        f"{shaped.name}: rounds on committed rows only: {clean}; rounds transformers slices one rejected row "
        f"into: {cut_rounds}, its drafts other than on the committed rows in {moved} of them"
    )
    assert clean >= len(PROMPTS) and cut_rounds > 0


# ---- the head's output, from the ASSISTANT's config.json -----------------------------------------------------


def test_head_step_scores_as_transformers_with_ordered_embeddings(models):
    """A head with ordered (centroid) embeddings: `hycoc.mtp.head_step` (the server-head chain and the head's
    training) gives transformers' centroid-masked logits, never the dense ones."""
    from hycoc.mtp import head_step, window_mask

    verifier, _ = models
    head = tiny_head(
        verifier,
        sliding_window=SHAPES["gemma4"][1],
        use_ordered_embeddings=True,
        num_centroids=16,
        centroid_intermediate_top_k=4,
    )
    with torch.no_grad():
        head.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5)))
        head.masked_embedding.centroids.weight.normal_(0.0, 1.0)
        out = verifier(input_ids=torch.tensor([PROMPTS[1]]), output_hidden_states=True, return_shared_kv_states=True)
        t = len(PROMPTS[1])
        x = torch.cat([verifier.model.embed_tokens(torch.tensor([[7]])), out.hidden_states[-1][:, -1:]], -1)
        kv = out.shared_kv_states
        pos = torch.tensor([[t]])
        ref = head(inputs_embeds=x, position_ids=pos, shared_kv_states=kv, use_cache=False)
        masks = {kind: window_mask(torch.tensor([[t]]), t, None) for kind in (SLIDING, FULL)}
        logits, h_next = head_step(head, x, kv, masks, pos)
        dense = head.lm_head(
            head.model(
                inputs_embeds=head.pre_projection(x), position_ids=pos, shared_kv_states=kv, use_cache=False
            ).last_hidden_state
        )
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h_next, ref.last_hidden_state, rtol=1e-5, atol=1e-5)
    assert (logits == logits.min()).sum() == VOCAB - 4 * VOCAB // 16  # all but the top-4 centroids' tokens
    assert not torch.allclose(logits, dense)


def _toy_copy(tmp_path, edit) -> Path:
    """recipes/toy.toml pointed at a copy of the toy models' configs (no weights) whose head config.json is
    ``edit``ed."""
    import json
    import shutil

    models = RECIPES / "toy" / "models"
    for role in ("verifier", "head", "slm"):
        shutil.copytree(models / role, tmp_path / role, ignore=shutil.ignore_patterns("*.safetensors"))
    path = tmp_path / "head" / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    text = (RECIPES / "toy.toml").read_text()
    for role in ("verifier", "head", "slm"):
        text = text.replace(f'"toy/models/{role}"', f'"{tmp_path / role}"')
    (tmp_path / "toy.toml").write_text(text)
    return tmp_path / "toy.toml"


def test_ordered_embeddings_are_refused_at_inspect_and_build(tmp_path):
    from hycoc.passes.build import build_inputs
    from typer.testing import CliRunner

    from hycoc.cli import app
    from hycoc.models import HeadConfigError

    path = _toy_copy(tmp_path, lambda c: {**c, "use_ordered_embeddings": True})
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert result.exit_code == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1
        and "use_ordered_embeddings = true" in lines[0]
        and "set use_ordered_embeddings to false" in lines[0]
    )
    # build: refused before any model is loaded (the copy has no weights: loading would fail otherwise)
    with pytest.raises(HeadConfigError, match="num_centroids 2048, centroid_intermediate_top_k 32"):
        build_inputs(load_recipe(path))


def test_the_plan_takes_the_heads_output_from_its_own_config(tmp_path):
    from hycoc.passes.plan import real_shape_plan

    plan = real_shape_plan(GEMMA4)["graphs"]["head"]
    assert plan["input"] == {"hidden": "post_norm", "query_position_offset": 0, "sliding_positions": 1024}
    # the assumed head config copies nothing of the verifier's output (whose soft-cap is 30)
    assert plan["output"] == {
        "use_ordered_embeddings": False,
        "num_centroids": 2048,
        "centroid_intermediate_top_k": 32,
        "final_logit_softcapping": None,
        "softcap_applied": False,
    }

    def edit(config):
        config["text_config"]["final_logit_softcapping"] = 12.5
        return {**config, "num_centroids": 64, "centroid_intermediate_top_k": 8}

    out = real_shape_plan(load_recipe(_toy_copy(tmp_path, edit)))["graphs"]["head"]
    assert out["output"] == {
        "use_ordered_embeddings": False,
        "num_centroids": 64,
        "centroid_intermediate_top_k": 8,
        "final_logit_softcapping": 12.5,
        "softcap_applied": False,
    }
    assert out["input"] == {"hidden": "pre_norm", "query_position_offset": -1, "sliding_positions": 128}
