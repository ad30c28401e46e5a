"""The verifier as a Ray Serve deployment (verifier/ray_serve.py): two replicas of a tiny engine behind one WebSocket
endpoint. Sessions spread over both replicas and stay there; every reply equals the engine's own (a reference copy of
the same weights, called directly); killing one replica's process ends its sessions with a clear client error while
the other replica's sessions go on and new sessions go to a live replica; /healthz and /metrics cover every replica.
A session that ends normally leaves no ERROR in the proxy's log; the handshake timeout runs until an OPEN behind Ray
too; FastAPI's API docs are off; Ray's logs default to WARNING without the access log.

One Ray instance for the whole test (starting Ray and Serve costs most of its time); skipped without the ``serve``
extra.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.serve
from hycoc.cli._common import SERVE_INSTALL  # noqa: E402  (the one install command every hint gives)

ray = pytest.importorskip("ray", reason=f"Ray Serve is not installed: {SERVE_INSTALL}")
ray_serve = pytest.importorskip("hycoc.verifier.ray_serve")

# E402 below: these imports follow the importorskip above, so a run without ray skips the module instead of failing
from hycoc.runtime.transport import AuthRefused, ConnectionDropped, VerifierClient  # noqa: E402
from hycoc.verifier.engine import VerifierEngine  # noqa: E402
from hycoc.verifier.server import ServerLimits  # noqa: E402
from websockets.exceptions import ConnectionClosed  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from hycoc.protocol import wire  # noqa: E402
from hycoc.protocol.messages import DraftTree, ErrorReply, OpenRequest, Sampling  # noqa: E402

TESTS = Path(__file__).resolve().parent
SCALES = (0.1, 0.1, 0.05, 0.05, 0.05, 0.05)
ROWS = 7
HANDSHAKE_S = 2.0
TOKEN = "s3cret"  # clients send it as 'Authorization: Bearer', so the test also sees the proxy forward the header


class TinyEngine:
    """A tiny verifier engine (tests/tiny_models.py, seed 0), built inside the replica (picklable by reference:
    the replicas import this module, tests/ is on their PYTHONPATH)."""

    def __call__(self) -> VerifierEngine:
        import torch
        from tiny_models import tiny_head, tiny_verifier

        torch.set_num_threads(1)
        model = tiny_verifier(sharpen=3.0)
        return VerifierEngine(
            model, head=tiny_head(model), head_window=6, handoff_scales=SCALES, eos_token_ids=set(), max_context=128
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def request(i: int) -> OpenRequest:
    """Session i's OPEN: a Cloud+MTP session (the server drafts; each ROUND is the root alone), greedy."""
    return OpenRequest(
        prompt_ids=np.arange(20 + i, 32 + i, dtype=np.int32),
        sampling=Sampling(0.0, 64, 0.95),
        seed=i,
        acceptance="exact",
        epsilon=1.0,
        max_new_tokens=100,
        draft_place="cloud-mtp",
    )


class Pair:
    """A session on the deployment and the same session on the reference engine; `step` runs one round on both
    and checks the replies agree bit for bit."""

    def __init__(self, url: str, reference: VerifierEngine, i: int):
        req = request(i)
        self.client = VerifierClient(url, auth_token=TOKEN, timeout_s=30)
        self.client.open(req)
        self.ref = reference.open(
            req.prompt_ids, req.sampling, req.seed, req.acceptance, req.epsilon, req.draft_place, req.max_new_tokens
        )
        self.ref.prefill()
        self.seq = 0

    def step(self) -> None:
        root = np.array([self.ref.root], np.int32)
        got = self.client.round(DraftTree(self.seq, root, np.array([-1], np.int32)))
        want = self.ref.verify(root, [-1], self.seq)
        assert (got.seq, got.bonus) == (want.seq, want.bonus)
        np.testing.assert_array_equal(got.chain, want.chain)
        np.testing.assert_array_equal(got.samples, want.samples)
        np.testing.assert_array_equal(got.path_rows, want.path_rows)
        self.seq += 1


def replica_sessions(http: str) -> dict[str, int]:
    code, body = http_get(http + "/healthz")
    assert code == 200, body
    return {r["replica"]: r["sessions"] for r in json.loads(body)["replicas"] if r["status"] == "ok"}


def metric(text: str, name: str, replica: str, labels: str = "") -> float:
    prefix = f'{name}{{replica="{replica}"{"," + labels if labels else ""}}} '
    values = [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]
    assert len(values) == 1, (name, replica, text)
    return float(values[0])


def errors(text: str, kind: str, replicas) -> float:
    """hycoc_errors_total{kind} summed over the replicas (a replica without that error has no sample)."""
    return sum(
        metric(text, "hycoc_errors_total", r, f'kind="{kind}"')
        for r in replicas
        if f'hycoc_errors_total{{replica="{r}",kind="{kind}"}}' in text
    )


def test_merge_expositions_labels_every_sample_with_its_replica():
    a = (
        "# HELP x_total rounds\n# TYPE x_total counter\nx_total 3\n# HELP e_total errors\n# TYPE e_total counter\n"
        'e_total{kind="bad_root"} 2\n'
    )
    b = "# HELP x_total rounds\n# TYPE x_total counter\nx_total 5\n# HELP e_total errors\n# TYPE e_total counter\n"
    assert ray_serve.merge_expositions({"r1": a, "r2": b, "r3": None}) == (
        "# HELP hycoc_replicas verifier replicas by state (Ray Serve deployment HycocVerifier)\n"
        "# TYPE hycoc_replicas gauge\n"
        'hycoc_replicas{state="up"} 2\n'
        'hycoc_replicas{state="unreachable"} 1\n'
        "# HELP x_total rounds\n# TYPE x_total counter\n"
        'x_total{replica="r1"} 3\nx_total{replica="r2"} 5\n'
        "# HELP e_total errors\n# TYPE e_total counter\n"
        'e_total{replica="r1",kind="bad_root"} 2\n'
    )
    with pytest.raises(ValueError, match="replica r1: not a Prometheus sample line: 'x_total'"):
        ray_serve.merge_expositions({"r1": "x_total\n"})


def test_health_summary_counts_live_replicas():
    snap = {"replica": "r1", "pid": 7, "node": "10.0.0.1", "sessions": 3, "metrics": ""}
    code, body = ray_serve.health_summary([snap, RuntimeError("actor died")], {"model": "m"})
    assert code == 200
    assert body == {
        "status": "degraded",
        "model": "m",
        "sessions": 3,
        "replicas_up": 1,
        "replicas": [
            {"replica": "r1", "pid": 7, "node": "10.0.0.1", "sessions": 3, "status": "ok"},
            {"replica": None, "status": "unreachable", "error": "RuntimeError: actor died"},
        ],
    }
    assert ray_serve.health_summary([RuntimeError("x")], {})[0] == 503


@pytest.fixture(scope="module")
def deployment():
    """Two replicas of TinyEngine on a fresh local Ray instance; yields (ws url, http url)."""
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    context = ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        port = free_port()
        # INFO: the proxy writes an access-log line when a session ends (test_a_normal_session_end_logs_no_error).
        app = ray_serve.build_app(
            TinyEngine(),
            replicas=2,
            cpus_per_replica=1,
            log_level="INFO",
            server_kwargs={
                "tree_rows": ROWS,
                "model_name": "tiny",
                "auth_token": TOKEN,
                "limits": ServerLimits(max_sessions=8, handshake_timeout_s=HANDSHAKE_S),
            },
        )
        url = ray_serve.start(app, "127.0.0.1", port, log_level="INFO")
        yield url, f"http://127.0.0.1:{port}", Path(context.address_info["session_dir"]) / "logs" / "serve"
    finally:
        ray.shutdown()


def proxy_log(logs: Path) -> list[str]:
    return [line for f in sorted(logs.glob("proxy_*.log")) for line in f.read_text(errors="replace").splitlines()]


def test_a_normal_session_end_logs_no_error(deployment):
    """A session that ends as hycoc's client ends it (CLOSE, then the WebSocket's close at once) makes the proxy log
    its access line and nothing at ERROR (the replica used to send its own close after the client's, which Ray's
    proxy logged as an ERROR with a GeneratorExit traceback)."""
    url, http, logs = deployment
    reference = TinyEngine()()
    before = sum(" WS / " in line for line in proxy_log(logs))
    for i in range(3):
        pair = Pair(url, reference, i)
        pair.step()
        pair.client.close()
    deadline = time.monotonic() + 20
    while True:  # until the three access lines are there, or an ERROR is
        lines = proxy_log(logs)
        if sum(" WS / " in line for line in lines) >= before + 3 or any(" ERROR " in line for line in lines):
            break
        assert time.monotonic() < deadline, "the proxy logged no access line for a session:\n" + "\n".join(lines)
        time.sleep(0.2)
    assert [line for line in lines if " ERROR " in line or "Traceback" in line] == []
    assert sum(re.search(r" WS / 1000 [0-9.]+ms", line) is not None for line in lines) >= before + 3


def test_handshake_timeout_behind_ray_runs_until_an_open_and_the_api_docs_are_off(deployment):
    url, http, _ = deployment
    # A text message is answered and does not end the handshake: HANDSHAKE_S after the accept, the replica closes.
    with connect(url, compression=None) as raw:
        t0 = time.monotonic()
        raw.send("hello")
        assert wire.decode(raw.recv(timeout=30)).code == "unexpected_message"
        error = wire.decode(raw.recv(timeout=30))
        took = time.monotonic() - t0
        assert isinstance(error, ErrorReply) and error.code == "handshake_timeout", error
        assert error.message == f"no OPEN within handshake_timeout_s = {HANDSHAKE_S:g} s of connecting"
        with pytest.raises(ConnectionClosed) as closed:
            raw.recv(timeout=30)
        assert closed.value.rcvd.code == 1008
    assert took > HANDSHAKE_S - 0.5  # not before the timeout; the recv timeouts above bound the wait
    health = json.loads(http_get(http + "/healthz")[1])
    assert health["limits"]["handshake_timeout_s"] == HANDSHAKE_S
    assert list(health["limits_not_applied"]) == ["frame_timeout_s"]
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert http_get(http + path)[0] == 404, path


def test_sessions_spread_stay_and_survive_a_replica_death(deployment):
    url, http, _ = deployment
    reference = TinyEngine()()

    code, body = http_get(http + "/healthz")
    health = json.loads(body)
    assert code == 200 and health["status"] == "ok" and health["replicas_up"] == 2 and health["sessions"] == 0
    assert (health["tree_rows"], health["limits"]["max_sessions"], health["limits_apply"]) == (ROWS, 8, "per replica")
    assert health["auth"] is True
    pids = {r["replica"]: r["pid"] for r in health["replicas"]}
    assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()
    before = http_get(http + "/metrics")[1]  # the module's earlier tests ran rounds too
    rounds = {r: metric(before, "hycoc_rounds_total", r) for r in pids}

    # Four sessions opened one after another: the proxy sends each to the replica with fewer ongoing requests (a
    # WebSocket is one until it closes), so both replicas get sessions.
    pairs = [Pair(url, reference, i) for i in range(4)]
    spread = replica_sessions(http)
    assert sum(spread.values()) == 4 and min(spread.values()) >= 1, spread
    for _ in range(2):
        for p in pairs:
            p.step()

    metrics = http_get(http + "/metrics")[1]
    for r in pids:
        assert metric(metrics, "hycoc_sessions_active", r) == spread[r]
        assert metric(metrics, "hycoc_rounds_total", r) == rounds[r] + 2 * spread[r]
    assert 'hycoc_replicas{state="up"} 2' in metrics

    # A text message gets the server's ERROR frame (the replica's own loop); a wrong token is refused (the proxy
    # forwards the Authorization header).
    with connect(url, compression=None, additional_headers={"Authorization": f"Bearer {TOKEN}"}) as raw:
        raw.send("hello")
        error = wire.decode(raw.recv(timeout=30))
        assert isinstance(error, ErrorReply) and error.code == "unexpected_message"
    with pytest.raises(AuthRefused, match="auth_refused"):
        VerifierClient(url, auth_token="wrong", timeout_s=30).open(request(0))
    metrics = http_get(http + "/metrics")[1]
    for kind in ("unexpected_message", "auth_refused"):  # each counted once, by the replica that answered it
        assert errors(metrics, kind, pids) == errors(before, kind, pids) + 1

    # Kill one replica's process: exactly its sessions end, each with ConnectionDropped naming the code and what to
    # do; the other replica's sessions go on.
    victim = min(spread, key=lambda r: pids[r])
    os.kill(pids[victim], signal.SIGKILL)
    survivors, dropped = [], 0
    for p in pairs:
        try:
            p.step()
            survivors.append(p)
        except ConnectionDropped as e:
            assert "WebSocket code 1006" in str(e) and "open a new session to continue" in str(e)
            dropped += 1
    assert (dropped, len(survivors)) == (spread[victim], 4 - spread[victim])
    for p in survivors:
        p.step()

    # A new session goes to a live replica (the survivor, or the replacement Ray starts) and is served exactly.
    fresh = Pair(url, reference, 9)
    fresh.step()
    deadline = time.monotonic() + 30
    while (sessions := replica_sessions(http)).get(victim) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert victim not in sessions and sum(sessions.values()) == len(survivors) + 1
    for p in survivors + [fresh]:
        p.client.close()


def test_serve_ray_refuses_a_busy_port_before_starting_ray():
    """A port already taken is named in one line before Ray starts (it used to fail ~20 s later in a Ray traceback)."""
    import socket
    from pathlib import Path

    from typer.testing import CliRunner

    from hycoc.cli import app

    recipe = Path(__file__).resolve().parents[1] / "recipes" / "toy.toml"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, ["serve-ray", str(recipe), "--replicas", "1", "--port", str(port)])
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"hycoc serve-ray: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(a verify-server on the default port?): pass --port N, or --port 0 for any "
        "free port"
    )


def test_serve_ray_log_levels():
    """Ray's logs at WARNING by default, without the per-request access log; INFO adds it; a bad level is named."""
    from typer.testing import CliRunner

    from hycoc.cli import app

    assert ray_serve.serve_logging().model_dump(include={"log_level", "enable_access_log"}) == {
        "log_level": "WARNING",
        "enable_access_log": False,
    }
    assert ray_serve.serve_logging("info").model_dump(include={"log_level", "enable_access_log"}) == {
        "log_level": "INFO",
        "enable_access_log": True,
    }
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "toy.toml"
    result = CliRunner().invoke(app, ["serve-ray", str(recipe), "--log-level", "LOUD"])
    assert result.exit_code == 2
    assert (
        result.stderr.strip() == "hycoc serve-ray: --log-level LOUD: one of DEBUG, INFO, WARNING, ERROR (Ray's "
        "logs; default WARNING)"
    )
