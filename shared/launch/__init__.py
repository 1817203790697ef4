"""The cluster launcher both stages use: a job description (program, config, GPUs) -> a launch plan
(nodes, ranks, rendered sbatch scripts / Kubernetes manifest) -> printed (dry run) or carried out.

Each stage's CLI builds its own plan (`train/launch.py`, `encode/launch.py`) and hands it here; nothing in
this package imports torch at import time, composer, train or encode.
"""
