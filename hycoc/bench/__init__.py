"""The benchmarks and what they measure with, one subpackage per job:

- `paper`: `hycoc bench`, the paper's benchmark (the runner, its records and requests, statistics, summary, tables,
  plots, text quality metrics, device time per round) and `hycoc tune-epsilon`;
- `loadtest`: `hycoc loadtest` (many simulated devices against one verifier: the run, its recorded rounds, its
  report) and the protocol fuzzer;
- `capacity`: `hycoc capacity` (the discrete-event simulation of many devices against verifier replicas, its step
  cost, the measured and the real-shape projections);
- `cost_model`: the verifier cost model (the model, the forwards a round runs, measuring it, the batched line);
- `real_shape`: the real-shape build checks' harness and inputs (benchmarks/real_shape_head.py, real_shape_slm.py).

Shared by several jobs, here at the top: Spec-Bench and the other datasets (`datasets`), the inputs the commands
find before they start (`inputs`), tables that fit the terminal (`tables`), the verify-server child process
(`verifier_process`) and the device runtime's step timers (`runtime_timing`). torch-free at import: the device
side may read datasets and cost models."""
