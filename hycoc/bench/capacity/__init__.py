"""`hycoc capacity` (docs/capacity.md): the discrete-event simulation (`simulation`) of simulated devices
(`requests`) against verifier replicas, what a step costs (`cost`, `gpu_cost`, `host`, `measure`, `speed_probe`),
the runs and the check against measured load tests (`run`, `sched_sampler`), the command's flows (`app`) and the
real-shape projection (`projection`, `trees`)."""
