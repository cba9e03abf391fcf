"""The measurements and the paper's comparisons: bench.py (the measurement commands, `python -m experiments.bench`)
over engine_speed.py, mechanisms.py (R3, TITO, CP Gated DeltaNet) and training.py (the trainer's Megatron path, the
copy gate, policy-gradient signal / noise); ranks.py (spawned gloo ranks: the CP figures and the tests); paper.py
(`python -m experiments.paper run`). The entry point train_t1.py imports none of this; the run report both use is
the top-level report.py."""
