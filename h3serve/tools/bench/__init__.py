"""The benchmarks behind `h3serve bench` (h3serve.entrypoints.bench parses its flags): the matrix of tasks x
shapes x engine configs, DiT forwards, throughput, several outputs, real-time sessions, FP8 blocks and the GPU
acceptance run."""
