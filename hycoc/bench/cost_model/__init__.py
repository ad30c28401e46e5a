"""The verifier cost model (docs/benchmarks.md "Benchmark": g projected; paper App. G): the model (`model`), the
forwards a round runs in its terms (`forwards`), measuring it (`measure`) and the batched line (`batch_line`).
torch-free at import."""
