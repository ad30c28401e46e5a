"""onnxruntime sessions of a bundle's graphs, on the backend the user asked for (docs/device-runtime.md).

``--backend cpu``: the bundle's QDQ ONNX on onnxruntime's CPU EP. ``--backend htp``: the bundle's EPContext model
on the QNN EP (``onnxruntime-qnn``, a plugin EP registered with ``register_execution_provider_library``; on an x86
host its HTP backend runs the context binary on the HTP simulator), CPU fallback disabled, the provider options
of the manifest's target (``htp_arch``, ``soc_model``).

A graph the bundle holds as layer shards (``slm.s0``, ``slm.s1``, ...; docs/compiler.md "Layer-sharded SLM": one
context binary per shard, each under the target's context budget) runs as `ShardChainRunner`, the shards chained by
tensor name; `open_graph` picks the runner.

`GraphRunner` checks the session's inputs and outputs against the manifest before the first run
(`hycoc.bundle.check_graph_io`) and converts between the runtime's float32 arrays and the graph's IO dtype: a
graph input declared as an integer type with an encoding is quantized with it (real = scale x (q - zero_point)),
an integer output is dequantized, except the ``codes`` outputs a caller keeps as integers. A bundle built with
``[target] quantized_io`` takes its KV rings as uint16 codes and gives its new KV rows as codes
(`hycoc.passes.graph_io`): the drafters then keep their rings as those codes (`input_buffer`, `input_encoding`) and
hand them over as they are; the other inputs stay float32 (their Q/DQ sit inside the graph).

The sessions themselves, their threads (cpu backend: one intra-op thread per session unless told otherwise, no
spinning) and provider options (htp backend) are `hycoc.runtime.graph_sessions`'.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from hycoc.runtime.graph_sessions import open_session
from hycoc.runtime.htp_session import HtpSessionSettings

from hycoc.bundle import (
    Encoding,
    GraphEntry,
    GraphIOMismatch,
    Manifest,
    ShardFeedMissing,
    TensorSpec,
    check_graph_io,
    shard_feeds,
)

_ORT_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(uint16)": "uint16",
    "tensor(int16)": "int16",
    "tensor(uint8)": "uint8",
    "tensor(int8)": "int8",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
}


class GraphRunError(RuntimeError):
    """A graph could not be loaded or run on the backend; the message names the graph and the cause."""


def quantize(x: np.ndarray, enc: Encoding) -> np.ndarray:
    """float -> the encoding's integer dtype: clip(round(x / scale) + zero_point) (ONNX QuantizeLinear)."""
    dtype = np.dtype(enc.dtype)
    info = np.iinfo(dtype)
    q = np.rint(np.asarray(x, np.float32) / np.float32(enc.scale)) + enc.zero_point
    return np.clip(q, info.min, info.max).astype(dtype)


def dequantize(q: np.ndarray, enc: Encoding) -> np.ndarray:
    """integer -> float32: (q - zero_point) x scale (ONNX DequantizeLinear)."""
    return (q.astype(np.int32) - enc.zero_point).astype(np.float32) * np.float32(enc.scale)


def input_buffer(runner, name: str) -> np.ndarray:
    """An array of input ``name``'s shape and dtype for a drafter to keep and update in place (its rings), holding
    real 0 (`zero_code`): the runner's `GraphRunner.input_buffer` when it has one (HTP shared memory), else in host
    memory. float32 unless the graph takes the input as integer codes (``[target] quantized_io``)."""
    make = getattr(runner, "input_buffer", None)
    if make is not None:
        return make(name)
    enc = input_encoding(runner, name)  # a chained runner's codes input, or float32
    return np.full(runner.shape(name), zero_code(enc), np.dtype(enc.dtype) if enc is not None else np.float32)


def input_encoding(runner, name: str) -> Encoding | None:
    """The encoding of input or output ``name`` when the graph takes or gives it as integer codes, else None."""
    spec = None
    for side in (getattr(runner, "inputs", None), getattr(runner, "outputs", None)):
        if isinstance(side, dict) and isinstance(side.get(name), TensorSpec):
            spec = side[name]
            break
    return spec.encoding if spec is not None and spec.dtype != "float32" and spec.encoding is not None else None


def zero_code(enc: Encoding | None):
    """The value a buffer holds for real 0: 0.0 for float32, the zero point for codes of ``enc``."""
    return 0.0 if enc is None else enc.zero_point


def runtime_outputs(entry: GraphEntry) -> list[str]:
    """The outputs the device runtime reads from a graph: all but ``logits`` when the graph emits its own top-k
    (``top_index``, `hycoc.passes.topk_outputs`), so the vocabulary-wide row is never copied out."""
    names = [t.name for t in entry.outputs]
    return [n for n in names if n != "logits"] if "top_index" in names else names


def code_outputs(entry: GraphEntry) -> list[str]:
    """The outputs a graph gives as integer codes of an encoding (its new KV rows when built with ``[target]
    quantized_io``): the drafters copy them into their integer rings as they are (`GraphRunner` ``codes``)."""
    return [t.name for t in entry.outputs if t.dtype != "float32" and t.encoding is not None]


def _refuse_shared_binary_on_simulator(manifest: Manifest, entry: GraphEntry) -> None:
    """Raise GraphRunError, before onnxruntime sees it, for a weight-shared context binary (one file named by
    several graphs: ``[target] share_weights``) on an x86 host: the x86 HTP simulator cannot load one (onnxruntime-qnn's
    x86_64 wheel segfaults in the session constructor, observed with 2.7.0 / QNN 2.51), so the bundle must be
    rebuilt with ``share_weights = false`` to run there. Nothing on an Arm host (the phone) or for an own binary."""
    import platform

    if entry.context_binary is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return
    others = [g.name for g in manifest.graphs if g.context_binary == entry.context_binary and g.name != entry.name]
    if others:
        raise GraphRunError(
            f"graph {entry.name}: its context binary {entry.context_binary} is weight-shared with "
            f"{', '.join(others)}, which the x86 HTP simulator cannot load: rebuild the bundle with "
            "[target] share_weights = false to run it here (keep true for a phone)"
        )


def _wanted_outputs(name: str, entry: GraphEntry, wanted: Sequence[str] | None) -> list[str]:
    """The outputs of graph ``name`` a runner returns, in ``entry``'s order: all (``wanted`` None) or ``wanted``.
    Raises GraphIOMismatch for a wanted output the graph does not have."""
    names = [t.name for t in entry.outputs]
    if wanted is None:
        return names
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise GraphIOMismatch(f"graph {name} has no output {', '.join(unknown)}; it has {', '.join(names)}")
    return [n for n in names if n in wanted]


@dataclass(frozen=True)
class RunnerSettings:
    """How a graph's session is opened and run: the settings `GraphRunner`, `ShardChainRunner` and `open_graph` share
    (what each does: `GraphRunner`'s docstring). ``threads``: intra-op threads of a cpu session (None: one, as
    `hycoc.runtime.graph_sessions` sets); ``io_binding`` / ``output_sets``: onnxruntime IOBindings and the output
    buffer sets used in turn; ``shared_memory``: HTP shared memory (htp only; implies io_binding); ``context_group``:
    join the EP context group (htp); ``codes``: outputs given back as integer codes; ``htp``: the QNN session
    settings (None: their defaults)."""

    threads: int | None = None
    io_binding: bool = False
    output_sets: int = 1
    shared_memory: bool = False
    context_group: bool = False
    codes: Sequence[str] = ()
    htp: HtpSessionSettings | None = None


class GraphRunner:
    """One graph of a bundle, loaded on ``backend`` (module docstring).

    ``run(feeds)`` takes float32 arrays by input name (every declared input, at its declared shape) and returns
    float32 arrays by output name (integer outputs without an encoding, such as ``top_index``, as they come).
    ``outputs``: the outputs to fetch (default all; onnxruntime then copies out only these, `runtime_outputs`).
    ``io_binding``: run through an onnxruntime IOBinding: an input array that is the same object as at the last
    call (the drafters' rings, updated in place) stays bound, not re-bound; outputs are written into
    ``output_sets`` preallocated sets of buffers used in turn, so a result stays valid for the next
    ``output_sets - 1`` calls (the SLM Drafter keeps a round's forwards until its commit). On the CPU EP a bound
    numpy input is read in place either way (measured: ``benchmarks/runtime_real_shape.py``).
    ``shared_memory`` (htp backend, implies ``io_binding``): the session gets the QNN EP's HTP shared-memory
    allocator, and `input_buffer` hands out inputs allocated from it (RPCMem the HTP reads without a copy), bound
    once as OrtValues; it needs `hycoc.targets.qnn_ep.htp_shared_memory_info` (a Snapdragon device's
    libcdsprpc.so), else SharedMemoryUnavailable.
    ``context_group`` (htp): the session joins the process's EP context group (``ep.share_ep_contexts=1``), as
    `ShardChainRunner`'s shards do.
    ``htp`` (htp): the QNN session settings (`hycoc.runtime.htp_session.HtpSessionSettings`: performance mode,
    context priority, RPC latency, finalization mode; None = its defaults), merged into the provider options by
    `htp_provider_options`.
    ``calls`` / ``seconds`` count the runs and their wall time.
    ``codes``: outputs given back as the graph's integer codes (not dequantized): the KV rows of a graph with
    quantized IO, which the drafters copy into their integer rings as they are. An integer input fed in its own
    dtype is passed on as codes; a float32 feed of an integer input is quantized with its encoding.
    Per run, a float32 input that is the very array object the last run checked (a drafter's buffer updated in
    place) is passed on without a new shape check or conversion (do not reshape such a buffer in place), and the
    outputs are converted only when the session's output types need it (float32 and integer outputs without an
    encoding come back as they are).
    Raises GraphRunError (load or run failure), GraphIOMismatch (the session disagrees with the manifest, or a
    feed has the wrong shape).
    """

    def __init__(
        self,
        bundle_dir: str | Path,
        manifest: Manifest,
        name: str,
        backend: str,
        outputs: Sequence[str] | None = None,
        settings: RunnerSettings = RunnerSettings(),
    ):
        self.entry: GraphEntry = manifest.graph(name)
        self._codes = frozenset(settings.codes)
        self._shared_info = None
        io_binding = settings.io_binding
        if settings.shared_memory:
            if backend != "htp":
                raise ValueError(
                    f"graph {name}: shared_memory is the QNN EP's HTP allocator, it needs the htp "
                    f"backend, not {backend}"
                )
            from hycoc.targets.qnn_ep import htp_shared_memory_info

            self._shared_info = htp_shared_memory_info()  # raises SharedMemoryUnavailable
            io_binding = True
        self._wanted, self._binding_sets = outputs, (settings.output_sets if io_binding else 0)
        self.name = name
        path = Path(bundle_dir) / self.entry.file
        if backend == "htp":
            _refuse_shared_binary_on_simulator(manifest, self.entry)
        t0 = time.perf_counter()
        try:
            self.session = open_session(
                path,
                backend,
                manifest,
                settings.threads,
                settings.shared_memory,
                settings.context_group,
                settings.htp,
            )
        except Exception as e:  # noqa: BLE001 - onnxruntime raises its own exception types
            raise GraphRunError(
                f"graph {name} ({self.entry.file}) did not load on the {backend} backend: "
                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
            ) from None
        self.load_seconds = time.perf_counter() - t0
        self._attach()

    @classmethod
    def from_session(
        cls,
        entry: GraphEntry,
        session,
        outputs: Sequence[str] | None = None,
        settings: RunnerSettings = RunnerSettings(),
    ) -> GraphRunner:
        """A runner around an already open onnxruntime ``session`` whose IO is ``entry``'s (benchmarks and tests
        with stand-in graphs); of ``settings`` only io_binding, output_sets and codes apply (the session is open).
        Raises GraphIOMismatch as the constructor."""
        runner = cls.__new__(cls)
        runner._codes = frozenset(settings.codes)
        runner.entry, runner.name, runner.session, runner.load_seconds = entry, entry.name, session, 0.0
        runner._shared_info = None
        runner._wanted = outputs
        runner._binding_sets = settings.output_sets if settings.io_binding else 0
        runner._attach()
        return runner

    def _attach(self) -> None:
        io = [
            [(a.name, list(a.shape), _ORT_DTYPES.get(a.type, a.type)) for a in side]
            for side in (self.session.get_inputs(), self.session.get_outputs())
        ]
        check_graph_io(self.entry, io[0], io[1])
        self.inputs: dict[str, TensorSpec] = {t.name: t for t in self.entry.inputs}
        self.outputs: dict[str, TensorSpec] = {t.name: t for t in self.entry.outputs}
        # per input: (name, spec, shape, float32 as is?); per output: its encoding (the run's conversions)
        self._input_specs = [(t.name, t, tuple(t.shape), t.dtype == "float32") for t in self.entry.inputs]
        self.output_names = _wanted_outputs(self.name, self.entry, self._wanted)
        self._output_encodings = [None if n in self._codes else self.outputs[n].encoding for n in self.output_names]
        # outputs the session gives as float32, or as integers without an encoding (top-k indices), come back as
        # they are: when all do, `run` converts nothing
        ort_types = {a.name: _ORT_DTYPES.get(a.type, a.type) for a in self.session.get_outputs()}
        self._outputs_as_is = all(
            ort_types.get(n) == "float32" or (enc is None and "int" in str(ort_types.get(n)))
            for n, enc in zip(self.output_names, self._output_encodings)
        )
        self._last_feeds: dict[str, np.ndarray] = {}  # input -> the array the last run took (validated then)
        self._last_ort_feeds: dict[str, np.ndarray] | None = None  # the last run's session feeds (`run_again`)
        self.calls, self.seconds = 0, 0.0
        self._shared: dict[int, tuple[Any, np.ndarray]] = {}  # id(view) -> (its OrtValue in HTP shared memory, view)
        # per output set: (IOBinding, its output buffers, the inputs bound last); None without io_binding
        self._binding: list[tuple[Any, dict[str, np.ndarray], dict[str, Any]]] | None = None
        if self._binding_sets:
            if self._binding_sets < 1:
                raise ValueError(f"graph {self.name}: output_sets must be >= 1, got {self._binding_sets}")
            types = {a.name: np.dtype(_ORT_DTYPES[a.type]) for a in self.session.get_outputs()}
            # one binding per output set, its outputs bound once to that set's buffers
            self._binding = []
            for _ in range(self._binding_sets):
                b = self.session.io_binding()
                bufs = {n: np.empty(self.outputs[n].shape, types[n]) for n in self.output_names}
                for n, buf in bufs.items():
                    b.bind_output(n, "cpu", 0, buf.dtype, list(buf.shape), buf.ctypes.data)
                self._binding.append((b, bufs, {}))
            self._next_set = 0

    def _run_bound(self, ort_feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """One run through the next IOBinding (class docstring): re-bind only inputs that are new objects; the
        outputs land in that binding's preallocated buffers."""
        assert self._binding is not None  # run() takes this path only with a binding
        b, bufs, bound = self._binding[self._next_set]
        self._next_set = (self._next_set + 1) % len(self._binding)
        for name, x in ort_feeds.items():
            if bound.get(name) is not x:
                shared = self._shared.get(id(x))
                if shared is not None and shared[1] is x:  # an `input_buffer`: its OrtValue, no copy
                    b.bind_ortvalue_input(name, shared[0])
                else:
                    b.bind_cpu_input(name, x)
                bound[name] = x
        self.session.run_with_iobinding(b)
        return [bufs[n] for n in self.output_names]

    def shape(self, name: str) -> tuple[int, ...]:
        """Declared shape of input or output ``name``."""
        spec = self.inputs.get(name) or self.outputs[name]
        return tuple(spec.shape)

    def input_buffer(self, name: str) -> np.ndarray:
        """An array of input ``name``'s shape and dtype holding real 0 (float32 zeros, or the zero point of an
        integer input's encoding), for the caller to keep and update in place: in HTP shared memory when the runner
        has ``shared_memory`` (a numpy view of an OrtValue the run binds instead of copying), else in host memory.
        Raises GraphIOMismatch for an unknown input, or an integer one without an encoding."""
        spec = self.inputs.get(name)
        if spec is None or (spec.dtype != "float32" and spec.encoding is None):
            raise GraphIOMismatch(f"graph {self.name}: no float32 or encoded input {name} to allocate")
        dtype = np.dtype(spec.dtype)
        fill = zero_code(None if spec.dtype == "float32" else spec.encoding)
        if self._shared_info is None:
            return np.full(spec.shape, fill, dtype)
        import onnxruntime as ort

        value = ort.OrtValue.ortvalue_from_shape_and_type(list(spec.shape), dtype, memory_info=self._shared_info)
        view = value.numpy()
        if view.ctypes.data != value.data_ptr():  # a copy would never reach the graph
            raise GraphRunError(
                f"graph {self.name}: onnxruntime gave a copy of the shared-memory input {name}, "
                "not a view; run without htp_shared_memory"
            )
        view[...] = fill
        self._shared[id(view)] = (value, view)
        return view

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        ort_feeds = {}
        last = self._last_feeds
        for name, spec, shape, plain in self._input_specs:
            x = feeds.get(name)
            if x is None:
                raise GraphIOMismatch(f"graph {self.name}: no feed for input {name}")
            if x is last.get(name):  # the very array the last run validated (a buffer kept in place)
                ort_feeds[name] = x
                continue
            if x.shape != shape:
                raise GraphIOMismatch(
                    f"graph {self.name}: input {name} has shape {list(x.shape)}, the graph takes {spec.shape}"
                )
            if plain or x.dtype == spec.dtype:  # float32, or integer codes of the input's own encoding
                ort_feeds[name] = y = np.ascontiguousarray(x, dtype=spec.dtype)
                if y is x:
                    last[name] = x
            elif spec.encoding is not None:
                ort_feeds[name] = quantize(x, spec.encoding)
            else:
                raise GraphIOMismatch(f"graph {self.name}: input {name} is {spec.dtype} without an encoding")
        self._last_ort_feeds = ort_feeds
        return self._call(ort_feeds)

    def run_again(self) -> dict[str, np.ndarray]:
        """`run` once more on the very arrays the last `run` passed (checked then), read as they are now: for a
        caller that updates its input buffers in place between runs (the MTP Drafter's K steps, paper Alg. 2
        lines 7-12), without going over the inputs again. Same outputs and errors as `run`; GraphIOMismatch
        before any run."""
        if self._last_ort_feeds is None:
            raise GraphIOMismatch(f"graph {self.name}: run_again before any run")
        return self._call(self._last_ort_feeds)

    def _call(self, ort_feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One session run on checked inputs; counts it and converts the outputs (`run`)."""
        t0 = time.perf_counter()
        try:
            outs = (
                self._run_bound(ort_feeds)
                if self._binding is not None
                else self.session.run(self.output_names, ort_feeds)
            )
        except Exception as e:  # noqa: BLE001 -- onnxruntime raises its own types; one GraphRunError for all
            raise GraphRunError(f"graph {self.name} failed to run: {str(e).splitlines()[0]}") from None
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        if self._outputs_as_is:
            return dict(zip(self.output_names, outs))
        result = {}
        for name, enc, y in zip(self.output_names, self._output_encodings, outs):
            kind = y.dtype.char
            if kind != "f":  # float32 comes as is
                if enc is not None:
                    y = dequantize(y, enc)
                elif y.dtype.kind == "f":
                    y = y.astype(np.float32)
            result[name] = y  # integer outputs without an encoding (top-k indices) stay integers
        return result


class ShardChainRunner:
    """A graph built as layer shards (``NAME.s0``, ``NAME.s1``, ... in the manifest, `Manifest.graph_chain`;
    docs/compiler.md "Layer-sharded SLM"), presented as one graph with `GraphRunner`'s contract, so `SlmDrafter` runs it
    unchanged.

    Each shard is a `GraphRunner` of its own (on htp: its own context binary); ``run(feeds)`` runs them in order,
    each shard's inputs taken by name from ``feeds`` or from an earlier shard's outputs (`hycoc.passes.slm.graph`
    "Shards"), and returns the chain's outputs (`hycoc.bundle.chain_io`: the last shard's, e.g. ``top_index`` /
    ``top_logq`` / ``logits``, and every shard's ``k_new_i`` / ``v_new_i``). ``entry``: the chain as one stand-in
    `GraphEntry`; ``outputs``: the chain outputs to return (default all); ``io_binding`` / ``output_sets`` as
    `GraphRunner` (each shard keeps ``output_sets`` sets, so a returned K/V row stays valid as long as with one
    graph). On htp the shards' sessions are one EP context group (session config ``ep.share_ep_contexts=1``,
    onnxruntime's EP-context sharing across sessions; measured on the x86 HTP simulator with two toy shard binaries:
    they load and give bit-identical outputs with and without it). ``calls`` / ``seconds`` count chain runs and
    their wall time; ``shards`` are the runners.
    Raises GraphRunError / GraphIOMismatch as `GraphRunner`, naming the shard.
    """

    def __init__(
        self,
        bundle_dir: str | Path,
        manifest: Manifest,
        name: str,
        backend: str,
        outputs: Sequence[str] | None = None,
        settings: RunnerSettings = RunnerSettings(),
    ):
        chain = manifest.graph_chain(name)
        self.name = name
        self.entry: GraphEntry = manifest.chain_entry(name)
        self.inputs: dict[str, TensorSpec] = {t.name: t for t in self.entry.inputs}
        self.outputs: dict[str, TensorSpec] = {t.name: t for t in self.entry.outputs}
        self.output_names = names = _wanted_outputs(name, self.entry, outputs)
        self.shards: list[GraphRunner] = []
        for k, g in enumerate(chain):
            later = {t.name for h in chain[k + 1 :] for t in h.inputs}
            wanted = [t.name for t in g.outputs if t.name in later or t.name in names]
            # rows a later shard reads stay codes when that shard takes codes (quantized IO): no round trip
            inner = [
                n
                for n in wanted
                if n in later and any(t.name == n and t.dtype != "float32" for h in chain[k + 1 :] for t in h.inputs)
            ]
            self.shards.append(
                GraphRunner(
                    bundle_dir,
                    manifest,
                    g.name,
                    backend,
                    wanted,
                    dataclasses.replace(
                        settings,
                        shared_memory=False,
                        context_group=True,
                        codes=sorted(set(inner) | (set(settings.codes) & set(wanted))),
                    ),
                )
            )
        self.load_seconds = sum(r.load_seconds for r in self.shards)
        self.calls, self.seconds = 0, 0.0

    def shape(self, name: str) -> tuple[int, ...]:
        """Declared shape of chain input or output ``name``."""
        spec = self.inputs.get(name) or self.outputs[name]
        return tuple(spec.shape)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        made: dict[str, np.ndarray] = {}
        for runner in self.shards:
            try:
                x = shard_feeds(runner.name, runner.inputs, feeds, made)
            except ShardFeedMissing as e:
                raise GraphIOMismatch(str(e)) from None
            made.update(runner.run(x))
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return {n: made[n] for n in self.output_names}


def open_graph(
    bundle_dir: str | Path,
    manifest: Manifest,
    name: str,
    backend: str,
    outputs: Sequence[str] | None = None,
    settings: RunnerSettings = RunnerSettings(),
) -> GraphRunner | ShardChainRunner:
    """Graph ``name`` of a bundle as one runner: a `GraphRunner`, or a `ShardChainRunner` when the bundle holds it
    as layer shards (`Manifest.graph_chain`). Arguments and errors as `GraphRunner`; shared_memory (HTP shared
    memory) is the single graph's only: a sharded graph's buffers stay in host memory."""
    chain = manifest.graph_chain(name)
    if len(chain) == 1 and chain[0].name == name:
        return GraphRunner(bundle_dir, manifest, name, backend, outputs, settings)
    return ShardChainRunner(bundle_dir, manifest, name, backend, outputs, settings)
