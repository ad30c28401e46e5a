"""`hycoc loadtest` (docs/serving.md "Load test: `hycoc loadtest`"): many simulated devices against one verifier
(`run`), the recorded device rounds they replay (`trace`) and what a run measured (`report`); and the protocol
fuzzer (`protocol_fuzz`, docs/serving.md "Soak and fuzz")."""
