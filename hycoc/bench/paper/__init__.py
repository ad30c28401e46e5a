"""`hycoc bench`, the paper's benchmark (paper §4, App. G; docs/benchmarks.md): the run (`runner`) and its requests
(`request_loop`), records (`records`), scores (`scoring`, `quality`), statistics (`stats`), summary (`summary`, its
types `summary_schema`), tables (`report_tables`, `turns`, `long_context`), plots (`plots`) and device time
(`device_profile`); and `hycoc tune-epsilon` (`tune_epsilon`)."""
