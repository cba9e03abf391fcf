"""The measurements (bench) and the paper's comparisons (paper); run as `python -m experiments.bench ...`,
`python -m experiments.paper ...`. The entry point train_t1.py imports none of this."""
