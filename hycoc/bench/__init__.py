"""`hycoc bench` and what it measures with: the benchmark runner (`runner`), its statistics (`stats`), text quality
metrics (`quality`), the ε tuner (`tune_epsilon`), Spec-Bench loading (`datasets`) and the verifier cost model
(`cost_model`). torch-free at import: the device side may read datasets and cost models."""
