"""The SLM Drafter's passes (paper Alg. 3, App. A Table 3): checkpoint surgery (`surgery`), the static tree graph
(`graph`, with `layers`), the 1-row decode graph (`decode`), its calibration inputs (`calibration`), and the graph
split by layers (`shards`: the plan; `shard_build`: export and QDQ per shard)."""
