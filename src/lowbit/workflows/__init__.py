"""The library's quantization workflow: a typed job (job), its steps, one class per algorithm
(steps), and the run that copies a model, applies the steps, quantizes and evaluates (quantize).
`lowbit quantize` parses its flags into a QuantizeJob and calls quantize_job; so can any Python caller."""
