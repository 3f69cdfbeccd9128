"""The library's quantization workflow: a typed job (job), its steps, one class per algorithm
(steps), the run that copies a model, applies the steps, quantizes and evaluates (quantize), the
session that loads a model, prepares its text, runs jobs and writes checkpoints and reports
(session), and the layer-by-layer job's inputs (sequential). `lowbit quantize` parses its flags into
QuantizeJobs and hands them to a QuantizeSession; so can any Python caller."""
