"""`hycoc run` end to end on loopback (docs/device-runtime.md): the tiny recipe of tests/test_build.py built into a cpu
bundle, its verifier served by `ServerThread`, the device runtime talking to it through the real wire protocol.

At temperature 0 the verifier's p~ is one-hot, so every acceptance rule (exact, epsilon, any tree) must commit
exactly the verifier's greedy continuation: the runtime's text equals the verifier's own greedy generation token
for token, whatever its drafters propose.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch
from hycoc.passes import build as b
from hycoc.runtime import transport
from hycoc.runtime.client import load_runtime
from hycoc.verifier.loading import engine_from_recipe, server_options
from hycoc.verifier.server import ServerThread
from rich.console import Console
from typer.testing import CliRunner

from hycoc.chat import Conversation
from hycoc.cli import app
from hycoc.protocol import wire
from hycoc.protocol.messages import Sampling

torch.set_num_threads(1)
GREEDY = Sampling(0.0, 64, 0.95)
LONG = " ".join(f"w{i}" for i in range(3, 60, 2))
MAX_NEW = 40  # > the tiny recipe's windows (16 / 8): the rings wrap around several times


@pytest.fixture(scope="module")
def built(tiny_bundle):
    return tiny_bundle.recipe, tiny_bundle.bundle


@pytest.fixture(scope="module")
def server(built):
    recipe, out = built
    keep = torch.as_tensor(np.load(out / "keep_set.npy"))
    engine = engine_from_recipe(recipe, device="cpu", keep_set=keep)
    with ServerThread(engine, **server_options(recipe)) as srv:
        yield srv, engine
    engine.close()


@pytest.fixture(scope="module")
def runtime(built):
    return load_runtime(built[1], "cpu", threads=1)


def prompt_ids(runtime, text="w1 w2 w3 w4 w5"):
    return runtime.bundle.chat.prompt(text)


def greedy_reference(engine, ids, max_new, stops):
    """The verifier's own greedy generation: one causal forward per token, cut as the verifier commits."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(max_new):
            logits = engine.model(torch.tensor([out])).logits[0, -1]
            tok = int(torch.argmax(logits))
            out.append(tok)
            if tok in stops:
                break
    return out[len(ids) :]


@pytest.mark.parametrize("mode", ["hyco-exact", "hyco", "specedge", "hyco-2p", "server-head", "cloud-mtp"])
def test_greedy_output_equals_the_verifiers_greedy_generation(server, runtime, mode):
    srv, engine = server
    ids = prompt_ids(runtime, LONG)  # longer than every ring: chunked SLM fill, hand-off windows of W rows
    assert len(ids) > 16
    want = greedy_reference(engine, ids, MAX_NEW, runtime.bundle.chat.stop_ids)
    pieces = []
    res = runtime.generate(
        transport.VerifierClient(srv.url),
        ids,
        mode=mode,
        max_new_tokens=MAX_NEW,
        sampling=GREEDY,
        on_text=pieces.append,
    )
    assert res.tokens == want
    assert 1 <= res.rounds <= len(want)  # random tiny drafters: acceptance is not the point here, exactness is
    assert "".join(pieces) == res.text
    m = res.to_json()
    assert m["tokens"] == len(want) and m["mat"] == pytest.approx(len(want) / res.rounds, abs=1e-4)
    # ROUND frame (protocol v4): 16-B header + 7 + 6 per row, + 2 per row's fp16 score (cloud-mtp: the root, none)
    up = wire.tree_nbytes(1, scores=False) if mode == "cloud-mtp" else wire.tree_nbytes(5)
    assert m["bytes_up_per_round"] == up == (23 + 6 if mode == "cloud-mtp" else 23 + 8 * 5)
    print(f"{mode:12s} tokens {m['tokens']} rounds {m['rounds']} MAT {m['mat']:.2f}")


def test_sampled_hyco_runs_and_reports_every_metric(server, runtime):
    srv, _ = server
    client = transport.VerifierClient(srv.url)
    res = runtime.generate(
        client,
        prompt_ids(runtime),
        mode="hyco",
        max_new_tokens=24,
        sampling=Sampling(1.0, 64, 0.95),
        seed=3,
        keep_open=True,
    )
    try:  # what the device committed is what the verifier's session committed, token for token
        (session,) = srv.server.sessions.values()
        assert res.tokens == session.output and len(res.tokens) >= 1
    finally:
        client.close()
    m = res.to_json()
    assert set(m) == {
        "text",
        "tokens",
        "rounds",
        "mat",
        "tok_per_s",
        "draft_ms_per_token",
        "server_ms_per_token",
        "first_token_ms",
        "bytes_up_per_round",
        "bytes_down_per_round",
        "finish_reason",
    }
    assert m["finish_reason"] in ("stop", "max_new_tokens")
    assert 1 <= m["tokens"] <= 24 and m["rounds"] >= 1 and m["server_ms_per_token"] > 0
    assert m["draft_ms_per_token"] > 0 and m["first_token_ms"] > 0 and m["bytes_down_per_round"] > 44


@pytest.fixture(scope="module")
def short_server(built, runtime):
    """A verifier whose context holds the test prompt plus 6 tokens (docs/serving.md "Limits": context)."""
    recipe, out = built
    engine = engine_from_recipe(recipe, device="cpu", keep_set=torch.as_tensor(np.load(out / "keep_set.npy")))
    engine.max_context = len(prompt_ids(runtime, LONG)) + 6
    with ServerThread(engine, **server_options(recipe)) as srv:
        yield srv, engine
    engine.close()


@pytest.mark.parametrize("mode", ["hyco-exact", "specedge", "cloud-mtp", "server-head"])
def test_the_context_limit_ends_the_request_with_every_committed_token(short_server, runtime, mode):
    srv, engine = short_server
    ids = prompt_ids(runtime, LONG)
    want = greedy_reference(engine, ids, 6, runtime.bundle.chat.stop_ids)
    pieces = []
    res = runtime.generate(
        transport.VerifierClient(srv.url), ids, mode=mode, max_new_tokens=40, sampling=GREEDY, on_text=pieces.append
    )
    assert res.tokens == want and "".join(pieces) == res.text
    assert res.finish_reason == ("length" if len(want) == 6 else "stop")
    assert sum(res.accepted) + res.rounds == len(res.tokens)  # per-round counts are what was committed
    with pytest.raises(transport.ServerError, match="context_overflow"):  # no room left: refused at OPEN
        runtime.generate(transport.VerifierClient(srv.url), ids + [ids[-1]] * 6, mode=mode, sampling=GREEDY)


def test_cli_run_at_the_context_limit_exits_0_with_the_text(short_server, built, runtime):
    srv, _ = short_server
    result = CliRunner().invoke(app, [*greedy_run(built[1], srv.url, LONG, 40), "--json"])
    assert result.exit_code == 0, result.stderr
    (last,) = [json.loads(line) for line in result.stdout.splitlines()]  # --json: stdout is the object alone
    assert last["tokens"] <= 6 and last["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("mode", ["hyco-exact", "specedge", "cloud-mtp"])
def test_a_second_turn_continues_the_session_with_the_verifiers_greedy_text(server, runtime, mode):
    srv, engine = server
    chat, stops = runtime.bundle.chat, runtime.bundle.chat.stop_ids
    conv = Conversation(chat)
    first_turn = conv.ask(LONG)
    client = transport.VerifierClient(srv.url)
    first = runtime.generate(
        client, first_turn.ids, mode=mode, max_new_tokens=12, sampling=GREEDY, keep_open=True, anchor=first_turn.anchor
    )
    assert first.tokens == greedy_reference(engine, first_turn.ids, 12, stops)
    conv.answered(first_turn, first.tokens)
    rendered = conv.ask("w7 w8 w9")
    pieces = []
    second = runtime.next_turn(client, rendered.ids, anchor=rendered.anchor, max_new_tokens=12, on_text=pieces.append)
    assert second.tokens == greedy_reference(engine, rendered.ids, 12, stops)
    assert "".join(pieces) == second.text and second.finish_reason in ("stop", "max_new_tokens")
    session = next(iter(srv.server.sessions.values()))
    assert session.tokens[: len(rendered.ids)] == rendered.ids
    assert session.turns_prefill_ms == [pytest.approx(second.prefill_ms, rel=1e-6)]  # float32 on the wire
    client.close()


@pytest.fixture()
def large_template(server, runtime, tmp_path, monkeypatch):
    """Both sides on a template with Gemma 4's large form's behaviours (tests/chat_templates.py: an empty thought
    channel in the thinking-off prompt, thoughts stripped and answers trimmed in history): the bundle's chat and
    the verifier's chat format swapped for the bundle's with that template."""
    from chat_templates import LARGE

    from hycoc.chat import Chat, template_digest

    fmt = runtime.bundle.chat.format.model_copy(
        update={"template": LARGE, "template_sha256": template_digest(LARGE), "has_thinking": True}
    )
    monkeypatch.setattr(runtime.bundle, "chat", Chat(fmt, runtime.bundle.tokenizer))
    monkeypatch.setattr(server[1], "chat_format", fmt)
    return runtime.bundle.chat


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("mode", ["hyco-exact", "cloud-mtp"])
def test_three_turns_hold_the_templates_rendering_on_both_sides(server, runtime, large_template, mode, thinking):
    """After every APPEND: the verifier holds exactly the template's rendering of the whole conversation and its
    next logits equal a cold prefill's; the device's SLM ring and token history equal a cold start on it (the
    conversation fits the ring: a cold start fills it from position 0)."""

    srv, engine = server
    conv = Conversation(large_template, thinking)
    client = transport.VerifierClient(srv.url)
    rendered = conv.ask(" w1 w2 w3 ")
    res = runtime.generate(
        client, rendered.ids, mode=mode, max_new_tokens=10, sampling=GREEDY, keep_open=True, anchor=rendered.anchor
    )
    kinds = []
    for user in ("w4 w5\n", "w6"):
        conv.answered(rendered, res.tokens)
        rendered = conv.ask(user)
        res = runtime.next_turn(client, rendered.ids, anchor=rendered.anchor, max_new_tokens=10)
        # thinking off, the rendering drops the prompt's empty thought channel: the APPEND rolls back past it
        assert res.kept < len(conv.held) if not thinking else res.kept <= len(conv.held)
        assert res.tokens == greedy_reference(engine, rendered.ids, 10, large_template.stop_ids)
        session = next(iter(srv.server.sessions.values()))
        kinds.append(session.appends[-1].kind)
        held = session.tokens[: len(rendered.ids)]
        assert held == rendered.ids
        if mode != "cloud-mtp":
            assert runtime.slm.tokens[: len(rendered.ids)] == rendered.ids
    assert kinds and all(k in ("crop", "snapshot") for k in kinds)
    client.close()
    # after the last APPEND and its rounds: the whole conversation again, cold, gives what the rounds committed
    final = session.tokens
    with torch.no_grad():
        cold = engine.model(torch.tensor([final[:-1]])).logits[0, -1]
    assert int(torch.argmax(cold)) == final[-1] or session.finish_reason == "stop"


def greedy_run(bundle, url: str, prompt: str, max_new_tokens: int) -> list[str]:
    """`hycoc run`'s arguments for one greedy hyco-exact answer to ``prompt`` on the CPU backend."""
    args = ["run", str(bundle), "--server", url, "--prompt", prompt, "--backend", "cpu", "--mode", "hyco-exact"]
    return args + ["--temperature", "0", "--max-new-tokens", str(max_new_tokens)]


def run_help_json_keys() -> list[str]:
    """The --json keys `hycoc run --help` lists, in order."""
    import re

    shown = " ".join(CliRunner().invoke(app, ["run", "--help"], terminal_width=200).stdout.split())
    return re.search(r"one JSON object per answer and nothing else \(([a-z_, ]+)\)", shown).group(1).split(", ")


def test_cli_run_chat_answers_every_turn_on_one_session(server, built):
    srv, _ = server
    before = srv.server.metrics.sessions_total
    result = CliRunner().invoke(
        app, [*greedy_run(built[1], srv.url, "w1 w2 w3", 8), "--json", "--chat"], input="w4 w5\nw6\n\n"
    )
    assert result.exit_code == 0, result.stderr
    # --json: stdout is JSON lines alone, one object per answer (no text, no empty line between turns)
    turns = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(turns) == 3 and all(1 <= t["tokens"] <= 8 for t in turns)
    assert list(turns[0]) == run_help_json_keys()  # what --json writes is what run --help lists
    assert srv.server.metrics.sessions_total == before + 1  # one session for the whole conversation
    assert result.stderr.count("[hyco-exact: ") == 3 and result.stderr.count("> ") == 3
    # every turn labelled on stderr, the first one too, each before its answer's summary line
    assert re.findall(r"-- turn (\d+) --", result.stderr) == ["1", "2", "3"]
    assert result.stderr.index("-- turn 1 --") < result.stderr.index("[hyco-exact: ")
    # without --json: each answer's text, then an empty line before the next turn's
    args = [*greedy_run(built[1], srv.url, "w1 w2 w3", 8), "--chat"]
    plain = CliRunner().invoke(app, args, input="w4 w5\nw6\n\n")
    assert plain.exit_code == 0, plain.stderr
    assert plain.stdout == "".join(t["text"] + "\n\n" for t in turns)
    result = CliRunner().invoke(app, ["run", str(built[1]), "--server", srv.url, "--mode", "slm-alone", "--chat"])
    assert result.exit_code == 2 and "--chat needs a verifier" in result.stderr


def test_slm_alone_needs_no_server(runtime):
    res = runtime.generate(None, prompt_ids(runtime), mode="slm-alone", max_new_tokens=12)
    assert 1 <= len(res.tokens) <= 12 and res.rounds == len(res.tokens)
    assert all(runtime.bundle.keep_index[t] >= 0 for t in res.tokens)  # the SLM graph drafts over the keep set


def test_cli_run_streams_text_and_prints_json(server, built):
    """Without --json stdout is the answer text; with --json every stdout line is a JSON object (`| jq` works),
    the text is the object's, and a stderr that is no terminal gets the summary only."""
    srv, _ = server
    args = greedy_run(built[1], srv.url, "w1 w2 w3", 16)
    plain = CliRunner().invoke(app, args)
    assert plain.exit_code == 0, plain.stderr
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.stderr
    objects = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(objects) == 1 and result.stdout.endswith("}\n")
    (last,) = objects
    assert last["tokens"] <= 16 and plain.stdout == last["text"] + "\n"  # greedy: the same answer both times
    assert result.stderr.startswith("[hyco-exact: ") and result.stderr.count("\n") == 1


def test_cli_run_errors_are_one_line_with_a_nonzero_exit(built, tmp_path):
    bundle = built[1]
    runner = CliRunner()
    result = runner.invoke(
        app,
        ["run", str(bundle), "--server", "ws://127.0.0.1:9", "--prompt", "w1", "--backend", "cpu", "--timeout", "2"],
    )
    assert result.exit_code == 1
    assert result.stderr.strip().startswith("hycoc run: cannot reach the verifier at ws://127.0.0.1:9")
    # a corrupt bundle: one flipped byte in a LUT is refused before any session opens
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(bundle, bad)
    lut = bad / "luts" / "head_embedding_q.npy"
    data = bytearray(lut.read_bytes())
    data[-1] ^= 1
    lut.write_bytes(bytes(data))
    result = runner.invoke(app, ["run", str(bad), "--server", "ws://127.0.0.1:9", "--prompt", "w1", "--backend", "cpu"])
    assert result.exit_code == 1 and "sha256" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    # a cpu bundle on the htp backend: refused naming both values
    result = runner.invoke(
        app, ["run", str(bundle), "--server", "ws://127.0.0.1:9", "--prompt", "w1", "--backend", "htp"]
    )
    assert (
        result.exit_code == 1
        and "bundle built for target backend cpu (cpu), asked to run on htp: pass --backend cpu" in result.stderr
    )


@pytest.mark.qnn
def test_htp_bundle_on_the_simulator_gives_the_verifiers_greedy_text(built, server, tmp_path):
    """The same recipe built for htp-v81 (QNN context binaries, CPU fallback disabled) and run with --backend htp:
    on this x86 host the QNN EP's HTP backend runs the binaries on its simulator."""
    from hycoc.targets.qnn_ep import versions

    if versions().get("onnxruntime-qnn") is None:
        pytest.skip("onnxruntime-qnn is not installed")
    recipe, out = built
    htp = out.parent / "bundle-htp"
    if not htp.exists():
        b.build_bundle(
            recipe, "htp-v81", htp, out.parent / "cache", b.BuildSettings(console=Console(file=io.StringIO()))
        )
    rt = load_runtime(htp, "htp")
    assert rt.bundle.manifest.target.htp_arch == 81 and rt.mtp.runner.entry.context_binary
    srv, engine = server
    ids = prompt_ids(rt, LONG)
    want = greedy_reference(engine, ids, 12, rt.bundle.chat.stop_ids)
    res = rt.generate(transport.VerifierClient(srv.url), ids, mode="hyco-exact", max_new_tokens=12, sampling=GREEDY)
    assert res.tokens == want
    assert rt.slm.runner.calls >= res.rounds and rt.mtp.runner.calls >= 1  # both graphs ran on the simulator


def test_qnn_sdk_versions_compare_by_release(built):
    from hycoc.runtime.device_bundle import check_device, sdk_release

    from hycoc.bundle import TargetMismatch, load_manifest

    assert sdk_release("v2.51.0.260929181845") == sdk_release("2.51.0") == (2, 51, 0)
    manifest = load_manifest(built[1])
    htp = manifest.model_copy(
        update={"target": manifest.target.model_copy(update={"backend": "htp", "htp_arch": 81, "qnn_sdk": "v2.51.0.1"})}
    )
    check_device(htp, "htp", qnn={"onnxruntime-qnn": "2.7.0", "qnn_sdk": "2.51.0"})
    with pytest.raises(TargetMismatch, match="bundle built for QNN SDK v2.51.0.1, this device has 2.50.0"):
        check_device(htp, "htp", qnn={"onnxruntime-qnn": "2.6.0", "qnn_sdk": "2.50.0"})
    with pytest.raises(TargetMismatch, match="onnxruntime-qnn is not installed"):
        check_device(htp, "htp", qnn={"onnxruntime-qnn": None, "qnn_sdk": None})


def test_a_bundle_whose_chat_contract_differs_is_refused_at_open(server, runtime):
    """The device's stop ids / turn strings travel in OPEN; the verifier refuses a mismatch naming both, and the
    OPENED of a matching OPEN carries the verifier's stop ids (its generation_config.json's)."""
    import json as _json

    from hycoc.protocol.messages import OpenRequest

    srv, _ = server
    good = runtime.bundle.chat.format.contract()
    client = transport.VerifierClient(srv.url)
    opened = client.open(OpenRequest(prompt_ids=np.asarray(prompt_ids(runtime), np.int32), chat=good))
    assert opened.stop_ids == (1, 6)
    client.close()
    bad = _json.loads(good)
    bad["stop_ids"] = [1, 106, 50]
    client = transport.VerifierClient(srv.url)
    with pytest.raises(
        transport.TransportError,
        match=r"chat_mismatch.*stop ids differ: the device's bundle stops "
        r"on \[1, 50, 106\], the verifier on \[1, 6\]",
    ):
        client.open(OpenRequest(prompt_ids=np.asarray(prompt_ids(runtime), np.int32), chat=_json.dumps(bad)))
    client.close()


def test_a_bundle_built_before_the_chat_format_is_refused(built, tmp_path):
    import shutil

    from hycoc.runtime.device_bundle import open_bundle

    from hycoc.bundle import Manifest, ManifestInvalid

    old = tmp_path / "old"
    shutil.copytree(built[1], old)
    m = Manifest.model_validate_json((old / "manifest.json").read_text()).model_copy(update={"chat": None})
    (old / "manifest.json").write_text(m.model_copy(update={"digest": m.content_digest()}).to_json())
    with pytest.raises(ManifestInvalid, match=r"no chat section .*rebuild it with `hycoc build"):
        open_bundle(old, "cpu")


def test_a_turn_that_stopped_on_a_stop_id_continues_as_the_template_renders(server, runtime):
    """A first answer that ends on a stop id (found by search: the tiny verifier is random): the next turn's
    rendering closes the model turn itself, and both sides hold that rendering (the verifier's session and the
    device's SLM)."""
    srv, engine = server
    chat, stops = runtime.bundle.chat, runtime.bundle.chat.stop_ids
    for i in range(200):
        ids = prompt_ids(runtime, f"w{i % 150} w{(7 * i) % 151}")
        want = greedy_reference(engine, ids, 10, stops)
        if want[-1] in stops:
            break
    else:
        raise AssertionError("no prompt of the search ends on a stop id within 10 tokens")
    client = transport.VerifierClient(srv.url)
    first = runtime.generate(client, ids, mode="hyco-exact", max_new_tokens=10, sampling=GREEDY, keep_open=True)
    assert first.tokens == want and first.finish_reason == "stop"
    rendered = chat.conversation(
        [
            {"role": "user", "content": f"w{i % 150} w{(7 * i) % 151}"},
            {"role": "assistant", "content": chat.answer_text(first.tokens)},
            {"role": "user", "content": "w7 w8"},
        ]
    )
    second = runtime.next_turn(client, rendered.ids, anchor=rendered.anchor, max_new_tokens=6)
    assert second.tokens == greedy_reference(engine, rendered.ids, 6, stops)
    session = next(iter(srv.server.sessions.values()))
    assert session.tokens[: len(rendered.ids)] == rendered.ids
    assert runtime.slm.tokens[: len(rendered.ids)] == rendered.ids
    client.close()
