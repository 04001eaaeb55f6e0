"""Interoperation with other benchmarking formats: `flashinfer` (FlashInfer-Bench's FlashInfer Trace)."""
