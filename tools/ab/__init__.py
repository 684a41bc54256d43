"""A/B timings of the engine's CPU paths, on and off side by side in one run: `attention` (attention.py's CPU
attention), `kernels` (activations.py's SwiGLU and malloc.py's buffer cache), `layout` (the weights as loaded
or stored [in, out], blas.transpose_weights).

    .venv/bin/python -m tools.ab.layout --help
"""
