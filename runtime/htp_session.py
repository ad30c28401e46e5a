"""How the device's QNN HTP sessions are set up (``hycoc run --backend htp``; docs/device-runtime.md "QNN session
settings"): the HTP performance mode, the context priority, the graph finalization mode and the RPC control
latency, as the onnxruntime QNN EP's provider options (onnxruntime-qnn ``docs/execution_providers/
QNN-ExecutionProvider.md``, "EP Provider Options": ``htp_performance_mode``, ``qnn_context_priority``,
``htp_graph_finalization_optimization_mode``, ``rpc_control_latency``).

The defaults are what Qualcomm's own LLM runtime configures: Genie's HTP backend extension config
(``htp_backend_ext_config.json`` as Qualcomm's AI Hub LLM exports write it) runs its cores at ``perf_profile:
burst`` with ``rpc_control_latency: 100`` (µs); the context priority stays QNN's ``normal``. onnxruntime's QNN EP
leaves the performance mode at ``default`` and the latency unset unless told. Setting them is necessary, not
sufficient: onnxruntime issue #24417 measured 11.8 tok/s through onnxruntime-genai's QNN EP against 17.1 under Genie
(1.45x) for AI Hub's Phi-3.5-mini on a v79 phone, both at ``burst``; the gap narrowed with both at ``balanced``, so
the reporter suspected how the EP applies the burst profile (Genie does it through its backend extensions).

The graph finalization mode applies where the EP finalizes (prepares) a graph; a bundle's EPContext graphs were
finalized when `hycoc build` compiled them (at the target profile's mode, `hycoc.targets.profiles.TargetProfile`), so
at run time it is passed on but only a graph the EP prepares itself is affected. None keeps the profile's.

The EP checks little itself (measured with onnxruntime-qnn 2.7.0 / QNN 2.51 on the x86 HTP simulator: an unknown
performance mode or finalization mode loads silently, an unknown priority fails at session load with "Invalid Qnn
context priority"), so `HtpSessionSettings` checks every value first and names the field and its choices.
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``htp_performance_mode`` values the QNN EP takes (onnxruntime-qnn's provider options table).
HTP_PERFORMANCE_MODES = (
    "burst",
    "sustained_high_performance",
    "high_performance",
    "balanced",
    "default",
    "low_balanced",
    "high_power_saver",
    "power_saver",
    "low_power_saver",
    "extreme_power_saver",
)
#: ``qnn_context_priority`` values (QNN's context priority; "normal" is QNN's default).
QNN_CONTEXT_PRIORITIES = ("low", "normal", "normal_high", "high")
#: ``htp_graph_finalization_optimization_mode``: "0" default, "1" faster preparation, "2" / "3" longer and better.
HTP_FINALIZATION_MODES = ("0", "1", "2", "3")
#: Upper end of ``rpc_control_latency`` (µs; QNN's HTP perf infrastructure holds it as a uint32).
MAX_RPC_CONTROL_LATENCY_US = 2**32 - 1


class HtpSettingError(ValueError):
    """A QNN session setting outside its choices: ``field`` (`HtpSessionSettings`'s), ``value`` and ``detail`` (the
    choices); the message is "HTP FIELD VALUE: DETAIL"."""

    def __init__(self, field: str, value: object, detail: str):
        super().__init__(f"HTP {field} {value!r}: {detail}")
        self.field, self.value, self.detail = field, value, detail


@dataclass(frozen=True)
class HtpSessionSettings:
    """The QNN HTP session settings of a run (module docstring): ``performance_mode`` (`HTP_PERFORMANCE_MODES`),
    ``context_priority`` (`QNN_CONTEXT_PRIORITIES`), ``finalization_mode`` (`HTP_FINALIZATION_MODES`; None = the
    target profile's), ``rpc_control_latency_us`` (0 = not set, else µs). Raises HtpSettingError (a ValueError)
    naming the field, the value and the choices for a value outside them."""

    performance_mode: str = "burst"
    context_priority: str = "normal"
    finalization_mode: str | None = None
    rpc_control_latency_us: int = 100

    def __post_init__(self) -> None:
        for field_name, value, choices in (
            ("performance_mode", self.performance_mode, HTP_PERFORMANCE_MODES),
            ("context_priority", self.context_priority, QNN_CONTEXT_PRIORITIES),
        ):
            if value not in choices:
                raise HtpSettingError(field_name, value, f"choose one of {', '.join(choices)}")
        if self.finalization_mode is not None and str(self.finalization_mode) not in HTP_FINALIZATION_MODES:
            raise HtpSettingError(
                "finalization_mode", self.finalization_mode, f"choose one of {', '.join(HTP_FINALIZATION_MODES)}"
            )
        latency = self.rpc_control_latency_us
        if isinstance(latency, bool) or not isinstance(latency, int) or not 0 <= latency <= MAX_RPC_CONTROL_LATENCY_US:
            raise HtpSettingError(
                "rpc_control_latency_us",
                latency,
                f"a whole number of microseconds in [0, {MAX_RPC_CONTROL_LATENCY_US}] (0 = not set)",
            )

    def provider_options(self) -> dict[str, str]:
        """The QNN EP provider options these settings add to a target profile's (strings, as the EP takes them):
        ``htp_performance_mode``, ``qnn_context_priority``, ``htp_graph_finalization_optimization_mode`` when set,
        ``rpc_control_latency`` when not 0."""
        out = {"htp_performance_mode": self.performance_mode, "qnn_context_priority": self.context_priority}
        if self.finalization_mode is not None:
            out["htp_graph_finalization_optimization_mode"] = str(self.finalization_mode)
        if self.rpc_control_latency_us:
            out["rpc_control_latency"] = str(self.rpc_control_latency_us)
        return out


__all__ = [
    "HTP_FINALIZATION_MODES",
    "HTP_PERFORMANCE_MODES",
    "MAX_RPC_CONTROL_LATENCY_US",
    "QNN_CONTEXT_PRIORITIES",
    "HtpSessionSettings",
    "HtpSettingError",
]
