"""The real-shape build checks' helpers (benchmarks/real_shape_head.py, benchmarks/real_shape_slm.py;
docs/real-shapes.md): the measuring harness (`harness`), the head's config and inputs (`head_shapes`), random E2B
checkpoints (`random_checkpoint`) and the SLM's ``--shards`` path (`shards`)."""
