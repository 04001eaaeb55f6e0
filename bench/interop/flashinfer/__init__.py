"""FlashInfer-Bench interoperation (docs/flashinfer.md): its FlashInfer Trace datasets as suites, its solutions as
implementations, our runs as its traces.

- `schema`: the FlashInfer Trace data models (definition, workload, solution, trace), restated.
- `dataset`: reading a dataset's files, every problem named by file and field.
- `mapping`: which definitions and workloads are cases (`gqa_ragged` prefill, `gqa_paged` prefill and decode) and
  why the others are not; `layout`: our tensors in their layout and back.
- `entries`, `solutions`, `plugin`: a definition's reference and a Solution's entry point as implementations.
- `crosscheck`, `compare`: their callables against the float64 oracle, by their rules.
- `importer` (`bench import flashinfer-trace`), `synth` and `export` (`bench export --format flashinfer-trace`).
"""
