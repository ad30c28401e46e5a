"""The MTP head's passes (paper Alg. 2, §3.2, App. A Tables 3-4): its static graph (`graph`), the 4-bit QAT (`qat`;
its integer format `quantize`, its data `captures` and `prompts`, `errors`), the export with its host tables
(`export`) and its calibration inputs (`calibration`)."""
