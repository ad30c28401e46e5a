"""The build cache's keys cover what a pass reads, a stale or damaged entry is never loaded, and the cache is
bounded (passes/pipeline.py, passes/cache.py, ``hycoc cache``, ``hycoc build --no-cache`` / ``--cache-max-size``;
docs/compiler.md "The build cache").

Small synthetic pipelines for the rules; the tiny recipe's real pipeline (conftest's ``tiny_pipeline``, copied)
for the one real case: each file the chat format is read from, changed in turn, reruns exactly the passes that
read it and, where their outputs change, the passes after them."""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from pathlib import Path

import pytest
from hycoc.passes.pipeline import Pass, PassReport, Pipeline
from rich.console import Console
from test_pipeline import Text  # a string artifact, saved as text.txt

from hycoc.chat_template import CHAT_FILES, chat_files, load_chat_format
from hycoc.recipe import Recipe

#: The chat format's JSON files (every one but the template), by label: each test edits them one by one.
JSON_CHAT_FILES = (
    "tokenizer/tokenizer_config.json",
    "tokenizer/tokenizer.json",
    "tokenizer/generation_config.json",
    "verifier/generation_config.json",
    "verifier/config.json",
)


class Reader(Pass):
    """Reads ``files`` (label -> path); its output is what ``make`` derives from their texts; counts its runs."""

    def __init__(self, name, files, make, consumes=(), produces="out"):
        self.name, self.files, self.make, self.runs = name, files, make, 0
        self.consumes = {k: Text for k in consumes}
        self.produces = {produces: Text}
        self.kind = produces

    def files_read(self, recipe):
        return dict(self.files)

    def run(self, inputs, recipe):
        self.runs += 1
        texts = {label: Path(p).read_text() if Path(p).exists() else "" for label, p in self.files.items()}
        texts |= {k: a.payload for k, a in inputs.items()}
        return {self.kind: Text(self.kind, self.make(texts))}, PassReport("made")


def quiet() -> Console:
    return Console(file=io.StringIO(), width=120)


def ran(result) -> list[str]:
    return [r.pass_name for r in result.reports if not r.cached]


# ---- a file a pass reads enters its key --------------------------------------------------------------------------


@pytest.fixture
def folder(tmp_path):
    """A tokenizer folder and a verifier folder with the six files the chat format is read from."""
    files = chat_files(tmp_path / "tok", tmp_path / "ver")
    for label, path in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{label} v1\n")
    return files


def test_each_file_reruns_exactly_the_passes_that_read_it_and_those_its_change_reaches(tmp_path, folder):
    # answers read every chat file, but only the template's text shapes their output (as a tokenizer_config.json
    # field the template never sees); train reads the answers; tok reads tokenizer.json alone; other reads nothing
    answers = Reader("answers", folder, lambda t: t["tokenizer/chat_template.jinja"], produces="a")
    train = Reader("train", {}, lambda t: t["a"] + "+trained", consumes=["a"], produces="b")
    tok = Reader("tok", {"t": folder["tokenizer/tokenizer.json"]}, lambda t: t["t"], produces="c")
    other = Reader("other", {}, lambda t: "constant", produces="d")
    pipe = Pipeline([answers, train, tok, other], tmp_path / "cache", console=quiet())
    assert ran(pipe.run(Recipe())) == ["answers", "train", "tok", "other"]
    expect = {
        "tokenizer/chat_template.jinja": ["answers", "train"],  # the answers change: train runs again
        "tokenizer/tokenizer_config.json": ["answers"],  # same answers: train stays cached
        "tokenizer/tokenizer.json": ["answers", "tok"],
        "tokenizer/generation_config.json": ["answers"],
        "verifier/generation_config.json": ["answers"],
        "verifier/config.json": ["answers"],
    }
    assert set(expect) == set(folder)
    for label, passes in expect.items():
        folder[label].write_text(f"{label} v2\n")
        assert ran(pipe.run(Recipe())) == passes, label
        assert ran(pipe.run(Recipe())) == [], label
    folder["tokenizer/chat_template.jinja"].unlink()  # a file that goes (or appears) changes what is read
    assert ran(pipe.run(Recipe())) == ["answers", "train"]


def test_the_chat_files_cover_every_file_the_chat_format_is_read_from(tmp_path):
    """What `load_chat_format` opens in the two folders (audit hooks) is among `chat_files`, for both places a
    template can be given."""
    from gemma4_fixture import write_tokenizer_folder
    from opened_files import recording

    for template_as in ("jinja", "config"):
        tok = write_tokenizer_folder(tmp_path / template_as / "tok", template_as=template_as)
        ver = tmp_path / template_as / "ver"
        ver.mkdir()
        (ver / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50]}))
        (ver / "config.json").write_text(json.dumps({"model_type": "gemma4_text"}))
        with recording() as opened:
            load_chat_format(tok, ver)
        read = {Path(p) for p in opened if Path(p).parent in (tok.resolve(), ver.resolve()) and Path(p).is_file()}
        assert read and read <= {p.resolve() for p in chat_files(tok, ver).values()}, read
    assert len(CHAT_FILES) == 6


def test_the_real_passes_that_read_the_chat_format_declare_its_files(tmp_path):
    """In `hycoc build`'s pipeline for the toy recipe the passes that read the chat format (its prompts or stop
    ids) key on its six files, and no other pass does."""
    from hycoc.passes.build import build_pipeline

    from hycoc.recipe import load_recipe

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "toy.toml")
    pipe = build_pipeline(recipe, "cpu", cache_dir=tmp_path)
    readers = {p.name: sorted(p.files_read(recipe)) for p in pipe.passes if p.files_read(recipe)}
    labels = sorted(f"{role}/{name}" for role, name in CHAT_FILES)
    assert readers == {"calibration_answers": labels, "qdq_head": labels, "qdq_slm": labels}


def test_library_versions_and_the_environment_enter_every_key(tmp_path, monkeypatch):
    from hycoc.passes import pipeline as pl

    assert {"torch", "transformers", "tokenizers", "jinja2", "onnxruntime"} <= set(pl.KEYED_PACKAGES)
    env = pl.environment()
    assert env["python"].count(".") == 1 and env["machine"] and env["torch_cpu"]
    p = Reader("p", {}, lambda t: "x")
    keys = {Pipeline([p], tmp_path, console=quiet()).cache_key(p, {}, Recipe())}
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    keys.add(Pipeline([p], tmp_path, console=quiet()).cache_key(p, {}, Recipe()))
    monkeypatch.setattr(pl, "tool_versions", lambda: {"jinja2": "0.0"})
    keys.add(Pipeline([p], tmp_path, console=quiet()).cache_key(p, {}, Recipe()))
    assert len(keys) == 3


# ---- a folder file that changes between the build and the server --------------------------------------------------


def test_a_folder_file_changed_after_the_build_is_named_by_the_chat_contract_check(tmp_path):
    """The bundle's chat format records each file's sha256; the server's own, read after a file changed, refuses
    the device's OPEN (chat_mismatch) naming the file, even where the change leaves template and stop ids alone."""
    from gemma4_fixture import write_tokenizer_folder

    from hycoc.chat import ChatMismatch

    tok = write_tokenizer_folder(tmp_path / "tok")
    ver = tmp_path / "ver"
    ver.mkdir()
    (ver / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106, 50]}))
    (ver / "config.json").write_text(json.dumps({"model_type": "gemma4_text"}))
    built = load_chat_format(tok, ver)
    assert sorted(built.files) == sorted(chat_files(tok, ver))
    built.check_contract(built.contract())  # unchanged: passes
    for label in JSON_CHAT_FILES:
        path = tmp_path / label.replace("tokenizer/", "tok/").replace("verifier/", "ver/")
        before = path.read_bytes()
        data = json.loads(before)
        if not label.endswith("tokenizer.json"):
            data["transformers_version"] = "9.9.9"  # a field the chat format does not read
        path.write_text(json.dumps(data, indent=3))  # tokenizer.json: the same tokenizer, other bytes
        served = load_chat_format(tok, ver)
        assert (served.template_sha256, served.stop_ids) == (built.template_sha256, built.stop_ids)
        role, name = label.split("/")
        with pytest.raises(ChatMismatch, match=rf"{name} of \[models\]\.{role} changed since the device's bundle"):
            served.check_contract(built.contract())
        path.write_bytes(before)
    (tok / "chat_template.jinja").write_text(load_chat_format(tok).template + "{{- '' -}}")
    with pytest.raises(ChatMismatch, match=r"chat templates differ.*chat_template\.jinja"):
        load_chat_format(tok, ver).check_contract(built.contract())
    older = json.loads(built.contract())
    del older["files"]  # a bundle built before the files were recorded: checked on template and stop ids
    built.check_contract(json.dumps(older))
    for bad in ([], {"tokenizer/tokenizer.json": 1}):
        with pytest.raises(ChatMismatch, match="not a map of file to sha256"):
            built.check_contract(json.dumps({**older, "files": bad}))


# ---- an entry is loaded whole or not at all ----------------------------------------------------------------------


def _entry(tmp_path):
    p = Reader("p", {}, lambda t: "payload")
    pipe = Pipeline([p], tmp_path, console=quiet())
    result = pipe.run(Recipe())
    return p, pipe, result.reports[0].location


@pytest.mark.parametrize(
    "damage",
    ["other library version", "other environment", "truncated output", "missing output", "bad meta", "bad report"],
)
def test_a_stale_or_damaged_entry_is_rebuilt_never_loaded(tmp_path, damage):
    p, pipe, entry = _entry(tmp_path)
    meta = json.loads((entry / "meta.json").read_text())
    if damage == "other library version":
        meta["tools"] = {**meta["tools"], "torch": "1.0.0"}
        (entry / "meta.json").write_text(json.dumps(meta))
    elif damage == "other environment":
        meta["environment"] = {**meta["environment"], "torch_cpu": "NEON"}
        (entry / "meta.json").write_text(json.dumps(meta))
    elif damage == "truncated output":
        (entry / "out" / "text.txt").write_text("pay")
    elif damage == "missing output":
        shutil.rmtree(entry / "out")
    elif damage == "bad meta":
        (entry / "meta.json").write_text('{"pass": "p", "vers')
    else:
        (entry / "report.json").write_text("[]")
    result = pipe.run(Recipe())
    assert p.runs == 2 and not result.reports[0].cached and result.artifacts["out"].payload == "payload"
    assert pipe.run(Recipe()).reports[0].cached  # and the rebuilt entry is whole


def test_no_cache_runs_every_pass_and_replaces_its_entry(tmp_path):
    p, pipe, entry = _entry(tmp_path)
    (entry / "marker").write_text("old")
    fresh = Pipeline([p], tmp_path, console=quiet(), use_cache=False)
    result = fresh.run(Recipe())
    assert p.runs == 2 and not result.reports[0].cached and result.reports[0].location == entry
    assert not (entry / "marker").exists() and (entry / "meta.json").is_file()
    assert not [x for x in (tmp_path / "p").iterdir() if x.name.startswith(".tmp-")]
    assert pipe.run(Recipe()).reports[0].cached


# ---- the cache's size: hycoc cache, the build's cap ------------------------------------------------------------


def _fill(cache: Path, sizes: dict[str, int], now: float) -> None:
    """Complete entries pass/key of ``sizes`` bytes, last used ``now - i`` hours ago in order (the first newest)."""
    for i, (name, size) in enumerate(sizes.items()):
        entry = cache / name
        entry.mkdir(parents=True)
        (entry / "blob").write_bytes(b"x" * size)
        (entry / "meta.json").write_text(json.dumps({"created": now - 3600 * (i + 1)}))
        os.utime(entry / "meta.json", (now - 3600 * i, now - 3600 * i))


def test_prune_by_size_keeps_the_most_recently_used_and_the_running_build(tmp_path):
    from hycoc.passes.cache import entries, prune

    now = time.time()
    _fill(tmp_path, {"a/k1": 100, "a/k2": 100, "b/k3": 100, "b/k4": 100}, now)
    (tmp_path / "a" / ".tmp-k5-x").mkdir()  # a killed build's leftover
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "build.log").write_text("kept")
    listed = entries(tmp_path)
    assert [(e.pass_name, e.key, e.complete) for e in listed][:2] == [("a", ".tmp-k5-x", False), ("a", "k1", True)]
    assert sum(e.bytes for e in listed) > 400 and "logs" not in {e.pass_name for e in listed}
    removed = prune(tmp_path, max_bytes=300, keep=[tmp_path / "b" / "k4"], dry_run=True)
    assert [e.key for e in removed] == ["k3", "k2", ".tmp-k5-x"]  # least recently used first
    assert (tmp_path / "b" / "k3").exists()  # a dry run removes nothing
    gone = {e.key for e in prune(tmp_path, max_bytes=300, keep=[tmp_path / "b" / "k4"])}
    assert gone == {".tmp-k5-x", "k3", "k2"}  # k4 is the oldest but kept; k1 the newest
    assert {e.key for e in entries(tmp_path)} == {"k1", "k4"} and (tmp_path / "logs" / "build.log").exists()


def test_prune_by_age(tmp_path):
    from hycoc.passes.cache import prune

    now = time.time()
    _fill(tmp_path, {"a/k1": 10, "a/k2": 10, "a/k3": 10}, now)
    assert {e.key for e in prune(tmp_path, older_than_s=1.5 * 3600, now=now)} == {"k3"}


def test_sizes_and_ages_parse_and_the_cli_default_is_the_documented_cap():
    from hycoc.passes.cache import DEFAULT_MAX_BYTES, CacheError, parse_age, parse_size

    assert parse_size("20GB") == DEFAULT_MAX_BYTES == 20 * 10**9
    assert (parse_size("500MB"), parse_size("1.5GiB"), parse_size("123")) == (500 * 10**6, 3 * 2**29, 123)
    assert (parse_age("30d"), parse_age("12h"), parse_age("90m")) == (30 * 86400, 12 * 3600, 90 * 60)
    for bad in ("lots", "20 parsecs", "-1GB"):
        with pytest.raises(CacheError, match="e.g. 20GB"):
            parse_size(bad)
    with pytest.raises(CacheError, match="e.g. 30d"):
        parse_age("forever")
    import typer.main

    from hycoc.cli import app

    build = typer.main.get_command(app).commands["build"]
    cap = next(p for p in build.params if p.name == "cache_max_size")
    assert cap.default == "20GB" and cap.envvar == "HYCOC_CACHE_MAX_SIZE"
    assert "--no-cache" in {o for p in build.params for o in p.opts}


def test_hycoc_cache_lists_and_prunes(tmp_path):
    from typer.testing import CliRunner

    from hycoc.cli import app

    now = time.time()
    _fill(tmp_path, {"keep_set/" + "a" * 64: 2000, "head_qat/" + "b" * 64: 3000}, now)
    runner = CliRunner()
    out = runner.invoke(app, ["cache", "--cache-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    assert "keep_set" in out.stdout and "aaaaaaaaaaaa" in out.stdout and "2.0 kB" in out.stdout
    assert "2 entries, 5." in out.stdout and "20.0 GB" in out.stdout
    dry = runner.invoke(app, ["cache", "prune", "--cache-dir", str(tmp_path), "--max-size", "3kB", "--dry-run"])
    assert dry.exit_code == 0 and "would remove head_qat/bbbbbbbbbbbb" in dry.stdout
    assert (tmp_path / "head_qat").exists()
    done = runner.invoke(app, ["cache", "prune", "--cache-dir", str(tmp_path), "--older-than", "30m"])
    assert done.exit_code == 0 and "removed 1 entry," in done.stdout and not (tmp_path / "head_qat").exists()
    bad = runner.invoke(app, ["cache", "prune", "--cache-dir", str(tmp_path), "--max-size", "big"])
    assert bad.exit_code == 2 and "e.g. 20GB" in bad.output
    assert runner.invoke(app, ["cache", "--cache-dir", str(tmp_path), "--dry-run"]).exit_code == 2
    empty = runner.invoke(app, ["cache", "--cache-dir", str(tmp_path / "none")])
    assert empty.exit_code == 0 and "no cache entries" in empty.stdout


def test_a_build_prunes_to_its_cap_and_keeps_its_own_entries(tiny_pipeline, tmp_path):
    """build_bundle with a 0-byte cap (all cache hits): the other entries go, the build's own stay whole."""
    from hycoc.passes import build as b
    from hycoc.passes.cache import entries

    cache = tmp_path / "cache"
    shutil.copytree(tiny_pipeline.cache, cache)
    now = time.time()
    _fill(cache, {"head_qat/" + "0" * 64: 1000}, now - 86400)  # another recipe's entry, used yesterday
    result = b.build_bundle(
        tiny_pipeline.recipe, "cpu", tmp_path / "bundle", cache, b.BuildSettings(console=quiet(), cache_max_bytes=0)
    )
    assert all(r.cached for r in result.pipeline.reports)
    assert [e.key for e in result.pruned] == ["0" * 64]
    assert {e.path for e in entries(cache)} == {r.location for r in result.pipeline.reports}


# ---- the real case: the tiny recipe's whole pipeline -------------------------------------------------------------

CHAT_READERS = ["calibration_answers", "qdq_head", "qdq_slm"]
AFTER_ANSWERS = ["calibration_answers", "head_qat", "head_export", "qdq_head", "qdq_slm", "slm_decode_graph"]


def _edit(folder: Path, label: str) -> None:
    """A change of ``label``'s file that leaves what hycoc reads of it as it was."""
    path = folder / label.split("/")[0] / label.split("/")[1]
    if label.endswith("tokenizer.json"):
        path.write_text(json.dumps(json.loads(path.read_text()), indent=1))  # the same tokenizer, other bytes
    else:
        data = json.loads(path.read_text())
        data["transformers_version"] = "9.9.9"  # a field the chat format and the models' hashes ignore
        path.write_text(json.dumps(data, indent=2))


@pytest.mark.slow
def test_the_tiny_recipe_reruns_exactly_what_each_folder_file_reaches(tiny_pipeline, tmp_path):
    """Replacing the chat template (the tokenizer folder's chat_template.jinja, which transformers prefers to
    tokenizer_config.json's) reruns calibration_answers and every pass after it that its answers reach; each other
    file, changed so that what is read of it stays, reruns the three passes that read the chat format and nothing
    after them (their outputs are bit-identical)."""
    from chat_templates import LARGE
    from hycoc.passes import build as b

    from hycoc.recipe import load_recipe

    root = tmp_path / "tiny"
    shutil.copytree(tiny_pipeline.root, root, ignore=shutil.ignore_patterns("bundle"))
    recipe = load_recipe(root / "recipe.toml")
    tok = root / "tokenizer"
    assert all(
        r.cached for r in b.run_pipeline(recipe, "cpu", root / "cache", b.BuildSettings(console=quiet())).reports
    )

    (tok / "chat_template.jinja").write_text(LARGE, encoding="utf-8")
    result = b.run_pipeline(recipe, "cpu", root / "cache", b.BuildSettings(console=quiet()))
    assert ran(result) == AFTER_ANSWERS + ["target_cpu"]  # keep_set, slm_surgery, slm_tree_graph stay cached

    for label in JSON_CHAT_FILES:
        _edit(root, label)
        assert ran(b.run_pipeline(recipe, "cpu", root / "cache", b.BuildSettings(console=quiet()))) == CHAT_READERS, (
            label
        )
